"""Model-level presets and the one function that builds a proxy from a preset name."""

from __future__ import annotations

import dataclasses
from typing import Union

import torch

from kosmos_moe import DEEPSEEK_V3, QWEN3_235B, MoEConfig, share_workspaces

from .common import MoERuntime, ProxyModel
from .deepseek_v3 import DeepSeekV3Config, DeepSeekV3Proxy
from .qwen3 import Qwen3Config, Qwen3Proxy

ProxyConfig = Union[DeepSeekV3Config, Qwen3Config]
_FAMILIES = {"deepseek_v3": DeepSeekV3Proxy, "qwen3": Qwen3Proxy}

PRESETS: dict[str, ProxyConfig] = {
    # Real layer shapes; two layers by default (DeepSeek-V3: the dense first layer + one MoE layer).
    "deepseek_v3": DeepSeekV3Config(),
    "qwen3_235b": Qwen3Config(),
    # CPU-sized: the same structure (MLA with a q/kv bottleneck and a shared rope key, a dense
    # first layer, group-limited sigmoid routing with a shared expert / GQA with QK-norm and
    # softmax routing), hidden 64, 8 experts.
    "deepseek_v3_tiny": DeepSeekV3Config(
        name="deepseek_v3_tiny", vocab_size=256, hidden_size=64, n_layers=3, n_dense_layers=1,
        dense_intermediate_size=128, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        moe=DEEPSEEK_V3.with_overrides(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
                                       n_group=4, topk_group=2),
    ),
    "qwen3_tiny": Qwen3Config(
        name="qwen3_tiny", vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        moe=QWEN3_235B.with_overrides(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2),
    ),
}


def get_config(preset: str, **overrides) -> ProxyConfig:
    """The preset's config with ``overrides`` applied (``moe=`` may be a dict of MoE overrides).

    A ``hidden_size`` override is carried into the MoE layer's shape too.

    >>> get_config("qwen3_235b", n_layers=4, vocab_size=32000)
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = PRESETS[preset]
    moe = overrides.pop("moe", None)
    if "hidden_size" in overrides and not isinstance(moe, MoEConfig):
        moe = {"hidden_size": overrides["hidden_size"], **(moe or {})}
    if isinstance(moe, dict):
        moe = config.moe.with_overrides(**moe)
    if moe is not None:
        overrides["moe"] = moe
    return dataclasses.replace(config, **overrides)


def build_model(
    config: ProxyConfig,
    runtime: MoERuntime | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> ProxyModel:
    """Build a proxy on ``device`` in ``dtype`` and initialise it from ``seed`` (see ``init_weights``).

    Its fused MoE layers, which run one after another, share one workspace per direction
    (:func:`kosmos_moe.share_workspaces`) instead of holding one each."""
    model = _FAMILIES[config.family](config, runtime, device=device, dtype=dtype)
    model.init_weights(seed)
    share_workspaces(model)
    return model


def build_skeleton(config: ProxyConfig, runtime: MoERuntime | None = None, *,
                   dtype: torch.dtype | None = None) -> ProxyModel:
    """The proxy's modules on the meta device: every parameter's shape and dtype (this rank's
    experts only, under ``runtime``'s EP group), no memory and no initialisation. For sizing a
    run before building it (:mod:`proxies.memory`)."""
    return _FAMILIES[config.family](config, runtime, device=torch.device("meta"), dtype=dtype)
