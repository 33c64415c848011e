"""Expert-parallel collectives over torch.distributed, with autograd, for the reference backend."""

from __future__ import annotations

import torch
import torch.distributed as dist


def ep_rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank and the size of the expert-parallel group (``None`` means one rank)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all of equal-sized int64 count blocks: block r of the result came from rank r."""
    _, world = ep_rank_and_world(group)
    if world == 1:
        return send_counts.clone()
    received = torch.empty_like(send_counts)
    dist.all_to_all_single(received, send_counts.contiguous(), group=group)
    return received


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = rows.new_empty(sum(output_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(input_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Variable-sized row exchange: send ``input_splits[r]`` rows to rank r, receive
    ``output_splits[r]`` from it. Differentiable: the gradient takes the reverse exchange."""
    _, world = ep_rank_and_world(group)
    if world == 1:
        return rows
    return _AllToAllRows.apply(rows, output_splits, input_splits, group)
