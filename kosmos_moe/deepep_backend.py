"""The ``deepep`` backend: DeepEP's ``Buffer`` for dispatch and combine, grouped-GEMM experts.

The end-to-end baseline for the proxies: the router and experts are the reference backend's;
only the exchange is DeepEP's normal-mode intranode dispatch/combine. Both exchanges are
autograd functions (dispatch's backward is a combine of the gradients, combine's backward a
cached dispatch). Nothing here builds or vendors DeepEP; it must be installed separately.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .experts import GroupedExperts
from .router import Routing

INSTALL_HINT = (
    "backend='deepep' needs DeepEP's Python package `deep_ep`, which kosmos-moe does not ship: build it "
    "on this machine from https://github.com/deepseek-ai/DeepEP (it needs NVSHMEM for its internode "
    "kernels; see its README), then check `python -c 'import deep_ep'`. To compare with the same API "
    "without DeepEP, pass deepep_buffer=kosmos_moe.deepep_compat.Buffer(group, ...)."
)


def make_buffer(group: dist.ProcessGroup | None, hidden_size: int, dtype: torch.dtype):
    """A ``deep_ep.Buffer`` for this group, sized as DeepEP's own examples size it."""
    try:
        import deep_ep
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    if group is None:
        group = dist.group.WORLD
    hidden_bytes = hidden_size * max(torch.tensor([], dtype=dtype).element_size(), 2)
    num_nvl_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
    return deep_ep.Buffer(group, num_nvl_bytes, 0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, buffer, num_experts):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, counts, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, *_):
        combined, combined_w, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w.contiguous())
        return combined, combined_w, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, handle, buffer):
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(y, handle)
        return combined

    @staticmethod
    def backward(ctx, grad):
        recv_grad, *_ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv_grad, None, None


def deepep_expert_forward(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts, num_experts: int,
                          buffer) -> torch.Tensor:
    """Routed-expert output ``[T, H]``: DeepEP dispatch, expert-major grouped SwiGLU, DeepEP combine."""
    top_k = routing.experts.shape[1]
    local = experts.gate_up_proj.shape[0]
    recv_x, recv_w, recv_idx, counts, handle = _Dispatch.apply(
        tokens, routing.weights.float(), routing.experts, buffer, num_experts)
    # Each received token goes to each of its local experts: expand to expert-major rows.
    flat = recv_idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, local), stable=True)
    n_rows = sum(counts)  # a host list from dispatch: no extra sync
    pairs = order[:n_rows]
    rows = recv_x.index_select(0, pairs // top_k)
    rows_per_expert = torch.tensor(counts, dtype=torch.int64, device=tokens.device)
    y = experts(rows, rows_per_expert, counts)
    weighted = y.float() * recv_w.reshape(-1).index_select(0, pairs)[:, None]
    per_token = torch.zeros(recv_x.shape[0], recv_x.shape[1], dtype=torch.float32, device=tokens.device)
    per_token = per_token.index_add(0, pairs // top_k, weighted)
    return _Combine.apply(per_token.to(tokens.dtype), handle, buffer)
