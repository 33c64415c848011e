"""Parts both proxies share: RMSNorm, RoPE, the dense SwiGLU MLP, the block, the model shell,
and how MoE layers are built (backend, expert-parallel group, token bound).

Parameter names follow Hugging Face transformers (``embed_tokens``, ``layers.{i}.self_attn``,
``input_layernorm``, ``post_attention_layernorm``, ``mlp``, ``norm``, ``lm_head``), so that a
reader who knows those models finds every weight where they expect it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kosmos_moe
from kosmos_moe import ExpertLayer, MoEConfig


def check_backend(backend: str) -> None:
    """Accept only the MoE backends this kosmos_moe has (``kosmos_moe.BACKENDS``)."""
    if backend not in kosmos_moe.BACKENDS:
        raise ValueError(
            f"unknown MoE backend {backend!r}: this kosmos_moe provides {', '.join(kosmos_moe.BACKENDS)}"
        )


@dataclass
class MoERuntime:
    """How the MoE layers of a model run, apart from their shape: backend and parallelism.

    ``group`` is the expert-parallel process group (``None``: one rank holds every expert).
    ``max_tokens_per_rank`` is the most tokens one rank feeds a layer in one call; the kosmos
    backend sizes its buffers from it (``batch * seq_len``).
    """

    backend: str = "reference"
    group: dist.ProcessGroup | None = None
    max_tokens_per_rank: int | None = None
    compute_aux_loss: bool = False
    layer_kwargs: dict = field(default_factory=dict)  # more ExpertLayer arguments (e.g. deepep_buffer)

    def __post_init__(self) -> None:
        check_backend(self.backend)
        if self.backend == "kosmos" and self.max_tokens_per_rank is None:
            raise ValueError("the kosmos backend needs max_tokens_per_rank (batch * seq_len per rank)")

    def layer(self, moe: MoEConfig, preset: str, factory: dict) -> ExpertLayer:
        """One MoE layer of shape ``moe`` from the named ExpertLayer preset's defaults."""
        build = {"deepseek_v3": ExpertLayer.deepseek_v3, "qwen3_235b": ExpertLayer.qwen3_235b}[preset]
        return build(
            **asdict(moe), group=self.group, backend=self.backend, max_tokens_per_rank=self.max_tokens_per_rank,
            compute_aux_loss=self.compute_aux_loss, **self.layer_kwargs, **factory,
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the activation dtype, cast back at the end."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(seq_len: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[seq_len, dim]`` for positions ``0..seq_len-1`` (half-split layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, D]`` by position; the rotation is done in fp32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, *, device=None, dtype=None) -> None:
        super().__init__()
        f = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, intermediate, **f)
        self.up_proj = nn.Linear(hidden, intermediate, **f)
        self.down_proj = nn.Linear(intermediate, hidden, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module, *, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def seed_of(*parts) -> int:
    """A 63-bit seed from any printable parts (stable across processes and runs)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class ProxyModel(nn.Module):
    """Token embedding, a stack of blocks, final RMSNorm and an untied LM head.

    ``forward(tokens [B, S]) -> logits [B, S, vocab]``. Subclasses build ``layers`` and set
    ``rope_dim`` and ``rope_theta``.
    """

    rope_dim: int
    rope_theta: float

    def __init__(self, config, layers: list[nn.Module], *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        f = dict(device=device, dtype=dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **f)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, **f)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **f)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(tokens.shape[-1], self.rope_dim, self.rope_theta, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def moe_layers(self) -> list[ExpertLayer]:
        return [m for m in self.modules() if isinstance(m, ExpertLayer)]

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' switch losses of the last forward (``compute_aux_loss`` runs)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init, independent of the expert-parallel layout.

        Every tensor draws from its own generator, seeded by (seed, name); routed experts by
        (seed, name, global expert id). So rank r of any EP size holds exactly the slice of
        experts that one rank holding all of them would: runs with different EP sizes start
        from the same model. Matrices ~ N(0, init_std), norm weights 1, the router's
        correction bias 0.
        """
        std = self.config.init_std
        for module_name, module in self.named_modules():
            if isinstance(module, ExpertLayer):
                first, _ = module.local_expert_range
                for pname in ("gate_up_proj", "down_proj"):
                    weight = getattr(module.experts, pname)
                    gen = torch.Generator(device=weight.device)
                    for local in range(weight.shape[0]):
                        gen.manual_seed(seed_of(seed, f"{module_name}.experts.{pname}", first + local))
                        weight[local].normal_(0.0, std, generator=gen)
                if module.gate.e_score_correction_bias is not None:
                    module.gate.e_score_correction_bias.zero_()
        for name, param in self.named_parameters():
            if ".experts." in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj"):
                continue
            if param.dim() == 1:  # norm weights
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(seed_of(seed, name))
            param.normal_(0.0, std, generator=gen)
