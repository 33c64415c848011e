"""Launch tests/distributed/fused_world.py under torchrun on 1, 2, 4 and 8 GPUs (those present)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the torchrun tests need CUDA devices"),
]

SCRIPT = Path(__file__).parent / "distributed" / "fused_world.py"
# NVLink multicast stays off on the lent machines.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fused_over_torchrun(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, **ENV, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(SCRIPT)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
