"""kosmos-moe: an expert-parallel MoE layer for PyTorch."""

from .config import DEEPSEEK_V3, QWEN3_235B, MoEConfig
from .layer import BACKENDS, ExpertLayer
from .router import Router, Routing, route_sigmoid_group, route_softmax

__all__ = [
    "BACKENDS",
    "DEEPSEEK_V3",
    "ExpertLayer",
    "MoEConfig",
    "QWEN3_235B",
    "Router",
    "Routing",
    "route_sigmoid_group",
    "route_softmax",
]
__version__ = "0.1.0"
