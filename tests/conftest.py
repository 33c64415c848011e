import sys
from pathlib import Path

# The oracle and the multi-process helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
