"""The reference backend: permute + all-to-all + grouped SwiGLU + all-to-all + fold, in torch.

This is the readable correctness oracle for the fused kernel and the baseline users would
otherwise run (the shape of Megatron's alltoall dispatcher and torchtitan's EP). It syncs with
the host once per call, to size the row exchange from the exchanged counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange

from .balance import tokens_per_expert
from .distributed import all_to_all_rows, ep_rank_and_world, exchange_counts
from .experts import GroupedExperts
from .router import Routing


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def reference_expert_forward(
    tokens: torch.Tensor,
    routing: Routing,
    experts: GroupedExperts,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` for local ``tokens`` ``[T, H]`` under ``routing``.

    Step by step: (1) order this rank's (token, k) pairs by global expert, which is also
    destination-rank-major; (2) exchange per-(rank, expert) counts; (3) exchange the rows;
    (4) permute received rows from source-major to expert-major; (5) SwiGLU experts;
    (6) undo (4) and exchange back; (7) undo (1) and fold ``sum_k w_k * y_k`` in at least fp32.
    """
    num_tokens, hidden = tokens.shape
    top_k = routing.experts.shape[1]
    _, world = ep_rank_and_world(group)
    local_experts = num_experts // world

    flat_experts = routing.experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    send_rows = tokens.index_select(0, order // top_k)
    # No host sync at EP=1, as in torchtitan's grouped_mm path: bincount on CUDA reads its
    # maximum on the host, and the grouped GEMMs take their offsets on the device (only the
    # per-expert loop that stands in for them off Hopper reads the counts on the host).
    send_counts = tokens_per_expert(flat_experts, num_experts)

    if world == 1:
        rows, rows_per_expert = send_rows, send_counts
        y = experts(rows, rows_per_expert)
        returned = y
    else:
        recv_counts = exchange_counts(send_counts, group)
        # One host sync: the split sizes of the row exchange, and the expert block sizes.
        counts_host = torch.stack([send_counts, recv_counts]).cpu()
        send_splits = counts_host[0].view(world, local_experts).sum(1).tolist()
        recv_by_source = counts_host[1].view(world, local_experts)
        recv_splits = recv_by_source.sum(1).tolist()
        rows_per_expert_list = recv_by_source.sum(0).tolist()

        received = all_to_all_rows(send_rows, recv_splits, send_splits, group)
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=tokens.device).repeat(world),
            recv_counts.to(tokens.device),
            output_size=received.shape[0],
        )
        to_expert_major = torch.argsort(local_expert_of_row, stable=True)
        rows = received.index_select(0, to_expert_major)
        rows_per_expert = recv_counts.view(world, local_experts).sum(0)
        y = experts(rows, rows_per_expert, rows_per_expert_list)
        y_source_major = y.index_select(0, _inverse_permutation(to_expert_major))
        returned = all_to_all_rows(y_source_major, send_splits, recv_splits, group)

    per_choice = rearrange(returned.index_select(0, _inverse_permutation(order)), "(t k) h -> t k h", k=top_k)
    fold_dtype = torch.promote_types(tokens.dtype, torch.float32)
    folded = torch.einsum("tkh,tk->th", per_choice.to(fold_dtype), routing.weights.to(fold_dtype))
    return folded.to(tokens.dtype)
