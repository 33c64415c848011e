"""kosmos-moe: an expert-parallel MoE layer for PyTorch."""

from pathlib import Path as _Path

# Installed, `kernels/` is the subpackage `kosmos_moe.kernels` (see pyproject.toml). Imported
# straight from a source checkout (the repository root on sys.path, as under pytest), that
# mapping is absent: search the root as well, so `kosmos_moe.kernels` is the same directory.
_root = _Path(__file__).resolve().parent.parent
if (_root / "kernels" / "__init__.py").is_file() and not (_root / "kosmos_moe" / "kernels").exists():
    __path__.append(str(_root))  # noqa: F821 (the package's own search path)

from .config import DEEPSEEK_V3, QWEN3_235B, MoEConfig
from .fused import ExpertLayerTimeout
from .layer import BACKENDS, ExpertLayer
from .router import Router, Routing, route_sigmoid_group, route_softmax
from .sharing import WorkspacePool, share_workspaces
from .workspace import workspace_bytes

__all__ = [
    "BACKENDS",
    "DEEPSEEK_V3",
    "ExpertLayer",
    "ExpertLayerTimeout",
    "MoEConfig",
    "QWEN3_235B",
    "Router",
    "Routing",
    "WorkspacePool",
    "route_sigmoid_group",
    "route_softmax",
    "share_workspaces",
    "workspace_bytes",
]
__version__ = "0.1.0"
