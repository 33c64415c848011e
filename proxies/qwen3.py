"""Qwen3-235B-A22B proxy: real-shape layers (GQA attention with QK-norm, every layer MoE), fewer of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kosmos_moe import QWEN3_235B, MoEConfig

from .common import Block, MoERuntime, ProxyModel, RMSNorm, apply_rope


@dataclass(frozen=True)
class Qwen3Config:
    name: str = "qwen3_235b"
    vocab_size: int = 151936
    hidden_size: int = 4096
    n_layers: int = 2
    n_heads: int = 64
    n_kv_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=lambda: QWEN3_235B)

    family = "qwen3"

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size={self.moe.hidden_size} differs from hidden_size={self.hidden_size}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs of the score and value matmuls per token, all layers, causal (half the square)."""
        per_layer_fwd = 2 * seq_len * self.n_heads * (2 * self.head_dim) / 2
        return 3 * per_layer_fwd * self.n_layers


class GQAttention(nn.Module):
    """Grouped-query attention with per-head RMSNorm of queries and keys before RoPE (Qwen3)."""

    def __init__(self, cfg: Qwen3Config, *, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        f = dict(bias=False, device=device, dtype=dtype)
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * d, **f)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * d, **f)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * d, **f)
        self.o_proj = nn.Linear(cfg.n_heads * d, cfg.hidden_size, **f)
        self.q_norm = RMSNorm(d, cfg.norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, c.n_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, c.n_kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, c.n_heads * c.head_dim))


class Qwen3Proxy(ProxyModel):
    def __init__(self, cfg: Qwen3Config, runtime: MoERuntime | None = None, *, device=None, dtype=None):
        runtime = runtime or MoERuntime()
        f = dict(device=device, dtype=dtype)
        layers = [
            Block(cfg.hidden_size, cfg.norm_eps, GQAttention(cfg, **f), runtime.layer(cfg.moe, "qwen3_235b", f), **f)
            for _ in range(cfg.n_layers)
        ]
        super().__init__(cfg, layers, **f)
        self.rope_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
