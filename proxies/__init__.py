"""DeepSeek-V3 and Qwen3-235B proxy models on kosmos_moe expert layers, and their training script.

A proxy keeps each layer of the real model at its real shape and has fewer layers::

    from proxies import MoERuntime, build_model, get_config
    config = get_config("deepseek_v3", n_layers=2, vocab_size=32000)
    model = build_model(config, MoERuntime(backend="reference"), device="cuda", dtype=torch.bfloat16)

Training: ``python -m proxies.train --help``.
"""

from .common import MoERuntime, ProxyModel, check_backend
from .deepseek_v3 import DeepSeekV3Config, DeepSeekV3Proxy
from .flops import active_params, flops_per_token, total_params
from .models import PRESETS, build_model, get_config
from .qwen3 import Qwen3Config, Qwen3Proxy

__all__ = [
    "DeepSeekV3Config",
    "DeepSeekV3Proxy",
    "MoERuntime",
    "PRESETS",
    "ProxyModel",
    "Qwen3Config",
    "Qwen3Proxy",
    "active_params",
    "build_model",
    "check_backend",
    "flops_per_token",
    "get_config",
    "total_params",
]
