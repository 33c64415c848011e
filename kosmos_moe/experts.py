"""SwiGLU expert weights and their grouped computation (reference path)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_mm_usable(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm is a Hopper/Blackwell bf16 kernel and needs 16-byte aligned strides;
    # everywhere else the per-expert loop below is the correct (if slower) path.
    return (
        hasattr(torch, "_grouped_mm")
        and rows.is_cuda
        and rows.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and rows.shape[0] > 0
        and rows.shape[-1] % 8 == 0
        and weight.shape[-2] % 8 == 0
        and torch.cuda.get_device_capability(rows.device)[0] >= 9
    )


def swiglu_experts(
    rows: torch.Tensor,
    rows_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    rows_per_expert_list: list[int] | None = None,
) -> torch.Tensor:
    """``y = (silu(x Wg^T) * (x Wu^T)) Wd^T`` for expert-major ``rows``.

    ``rows`` is ``[N, H]`` sorted by local expert, ``rows_per_expert`` the int64 ``[L]`` count
    of each expert's block. ``gate_up_proj`` is ``[L, 2I, H]`` (gate rows first) and
    ``down_proj`` ``[L, H, I]``. Returns ``[N, H]`` in the same order.
    """
    if _grouped_mm_usable(rows, gate_up_proj):
        offsets = torch.cumsum(rows_per_expert, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(rows, gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)
    if rows_per_expert_list is None:
        rows_per_expert_list = rows_per_expert.tolist()
    outputs = []
    for e, block in enumerate(torch.split(rows, rows_per_expert_list)):
        gate, up = F.linear(block, gate_up_proj[e]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, down_proj[e]))
    return torch.cat(outputs) if outputs else rows.new_empty(0, down_proj.shape[1])


class GroupedExperts(nn.Module):
    """The routed experts held by one rank, in the Hugging Face transformers v5 layout.

    ``gate_up_proj`` is ``[local_experts, 2 * moe_intermediate, hidden]`` with the gate rows
    first; ``down_proj`` is ``[local_experts, hidden, moe_intermediate]``.
    """

    def __init__(
        self, num_local_experts: int, hidden_size: int, intermediate_size: int, *, dtype=None, device=None
    ) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.num_local_experts = num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.gate_up_proj.shape[-1] ** -0.5)
        nn.init.normal_(self.down_proj, std=self.down_proj.shape[-1] ** -0.5)

    def forward(
        self, rows: torch.Tensor, rows_per_expert: torch.Tensor, rows_per_expert_list: list[int] | None = None
    ) -> torch.Tensor:
        return swiglu_experts(rows, rows_per_expert, self.gate_up_proj, self.down_proj, rows_per_expert_list)


class SharedExperts(nn.Module):
    """The always-on SwiGLU MLP of DeepSeek-style layers (``gate_proj``/``up_proj``/``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def shared_experts_backward(
    weights: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    grad_out: torch.Tensor,
    gate_up: torch.Tensor,
    dx: torch.Tensor | None,
    need_x: bool,
    need: dict[str, bool],
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The shared experts' gradients from their kept projections, without redoing their forward.

    ``gate_up`` ``[T, 2 I_s]`` is ``[x Wg^T | x Wu^T]`` as the forward computed it. The
    activation is recomputed elementwise; the GEMMs are ``dWd = G^T h``, ``dh = G Wd``,
    ``dWg = dg^T x``, ``dWu = du^T x`` and ``dx += dg Wg + du Wu``, each only if asked for.
    The elementwise steps are autograd's own for :class:`SharedExperts`, in the activation
    dtype, so the gradients round as its do.
    ``weights`` maps :class:`SharedExperts`' parameter names (``gate_proj.weight``, ...) to the
    tensors the forward used (saved by autograd: not the module's, which may have been swapped
    for the call, as under autocast). ``need`` maps the same names to whether their gradient is
    wanted. Returns ``dx`` (``None`` unless ``need_x``; a given ``dx`` is added into in place
    and returned) and those gradients by name.
    """
    wg, wu, wd = (weights[f"{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    want_g, want_u, want_d = (need.get(f"{p}.weight", False) for p in ("gate_proj", "up_proj", "down_proj"))
    grad_out = grad_out.to(x.dtype)
    # Contiguous halves, as autograd's forward had them: on a CPU with AVX-512, silu of a
    # strided view takes the scalar path for each row's tail, whose exp rounds differently.
    gate, up = (half.contiguous() for half in gate_up.chunk(2, dim=-1))
    act = F.silu(gate)
    grads = {}
    if want_d:
        grads["down_proj.weight"] = grad_out.t() @ (act * up)
    if need_x or want_g or want_u:
        dh = grad_out @ wd
        du = dh * act
        dg = torch.ops.aten.silu_backward(dh * up, gate)
        if want_g:
            grads["gate_proj.weight"] = dg.t() @ x
        if want_u:
            grads["up_proj.weight"] = du.t() @ x
        if need_x:
            # Products then adds, as autograd does for the module (the products round as its
            # do; the additions' order differs), not addmm: in an emulated world (every rank on
            # one GPU, one host thread) a cuBLAS kernel this process has not run yet, such as
            # addmm's beta-add variant, held the host until the device's running kernels ended
            # (H100, cuBLAS of torch 2.11), while the peers' persistent kernels waited for the
            # next rank's launch. EmulatedWorld.rehearse runs the module's own products once
            # per rank beforehand (tests/test_layer.py and tests/test_fused_backward_cpu.py
            # check that these are among them).
            dx = dg @ wg if dx is None else dx.add_(dg @ wg)  # one [T, H] product alive at a time
            dx.add_(du @ wu)
    return (dx if need_x else None), grads
