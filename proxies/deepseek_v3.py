"""DeepSeek-V3 proxy: real-shape layers (MLA attention, dense first layer, DeepSeek-V3 MoE), fewer of them.

Differences from the released model, none of which changes a layer's shape or FLOPs: plain
RoPE (theta 1e4) without the YaRN scaling, the first ``n_dense_layers`` layers dense (the
release has three), no multi-token-prediction module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kosmos_moe import DEEPSEEK_V3, MoEConfig

from .common import Block, DenseMLP, MoERuntime, ProxyModel, RMSNorm, apply_rope


@dataclass(frozen=True)
class DeepSeekV3Config:
    name: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    n_layers: int = 2
    n_dense_layers: int = 1
    dense_intermediate_size: int = 18432
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=lambda: DEEPSEEK_V3)

    family = "deepseek_v3"

    def __post_init__(self) -> None:
        if self.n_layers < 1 or not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"need n_layers >= 1 and 0 <= n_dense_layers <= n_layers, got "
                             f"n_layers={self.n_layers}, n_dense_layers={self.n_dense_layers}")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size={self.moe.hidden_size} differs from hidden_size={self.hidden_size}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs of the score and value matmuls per token, all layers, causal (half the square)."""
        per_layer_fwd = 2 * seq_len * self.n_heads * (self.qk_head_dim + self.v_head_dim) / 2
        return 3 * per_layer_fwd * self.n_layers


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), training form.

    Queries go through a low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``). Keys and
    values come from one compressed latent of ``kv_lora_rank`` plus a ``qk_rope_head_dim`` key
    part shared by all heads (``kv_a_proj_with_mqa``), expanded per head by ``kv_b_proj``. Each
    head's query/key is ``[nope | rope]`` (128 + 64), its value 128 wide.
    """

    def __init__(self, cfg: DeepSeekV3Config, *, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        f = dict(bias=False, device=device, dtype=dtype)
        h = cfg.n_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, **f)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device=device, dtype=dtype)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, **f)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, **f)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), **f)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, **f)
        self.softmax_scale = cfg.qk_head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, s, _ = x.shape
        h, nope, rope, dv = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, h, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, h, nope + dv).transpose(1, 2)
        k_nope, v = kv.split([nope, dv], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.view(b, 1, s, rope), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, h, s, rope)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h * dv))


class DeepSeekV3Proxy(ProxyModel):
    def __init__(self, cfg: DeepSeekV3Config, runtime: MoERuntime | None = None, *, device=None, dtype=None):
        runtime = runtime or MoERuntime()
        f = dict(device=device, dtype=dtype)
        layers = []
        for i in range(cfg.n_layers):
            if i < cfg.n_dense_layers:
                mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, **f)
            else:
                mlp = runtime.layer(cfg.moe, "deepseek_v3", f)
            layers.append(Block(cfg.hidden_size, cfg.norm_eps, MLAttention(cfg, **f), mlp, **f))
        super().__init__(cfg, layers, **f)
        self.rope_dim = cfg.qk_rope_head_dim
        self.rope_theta = cfg.rope_theta
