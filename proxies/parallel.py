"""Expert parallelism over the world, data parallelism over the rest, and gradient reduction.

With world W and EP size E (E divides W): the EP groups are consecutive ranks
``{k*E, ..., k*E + E-1}``; the DP groups take one rank from each, ``{j, j+E, j+2E, ...}``.
MoE layers get ``group=ep_group``; rank r holds the experts of EP rank ``r % E`` and shares
them with the rest of its DP group.

Gradients, for the loss ``L = mean over the W ranks of each rank's mean token loss``:

* replicated parameters (attention, norms, embeddings, head, router, shared experts): rank r's
  backward gives ``dL_r/dp``; ``dL/dp = sum over the world / W``;
* routed experts: the all-to-all brings every EP peer's rows to the expert, so rank r's
  backward gives ``sum over its EP group of dL_q/dp``; the DP group holds the replicas of that
  expert, so ``dL/dp = sum over the DP group / W`` (a mean over the DP group would be E times
  too large).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_BUCKET_ELEMENTS = 1 << 26  # 256 MB of fp32 per all-reduce


@dataclass
class Parallel:
    rank: int
    world: int
    ep: int
    ep_group: dist.ProcessGroup | None  # None: one rank (no expert parallelism)
    dp_group: dist.ProcessGroup | None  # None: no data-parallel replicas of the experts

    @property
    def dp(self) -> int:
        return self.world // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep


def init_distributed(device_type: str) -> tuple[int, int]:
    """Join the process group torchrun describes (or one that is already up); ``(rank, world)``."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_ep_size(ep: int, world: int, num_experts: int) -> None:
    if ep < 1:
        raise ValueError(f"--ep-size must be positive, got {ep}")
    if world % ep:
        raise ValueError(f"--ep-size {ep} does not divide the world size {world}")
    if num_experts % ep:
        raise ValueError(f"--ep-size {ep} does not divide the number of experts {num_experts}")


def build_parallel(ep: int, num_experts: int) -> Parallel:
    """Make the EP and DP groups (a collective: every rank calls it in the same order)."""
    if not dist.is_initialized():
        check_ep_size(ep, 1, num_experts)
        return Parallel(0, 1, 1, None, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    check_ep_size(ep, world, num_experts)
    dp = world // ep

    def group(ranks: list[int]) -> dist.ProcessGroup | None:
        if len(ranks) == 1:
            return None
        if len(ranks) == world:
            return dist.group.WORLD
        return dist.new_group(ranks)

    ep_group = dp_group = None
    # Every rank creates every group, in the same order (new_group is collective over the world).
    for k in range(dp):
        g = group([k * ep + j for j in range(ep)])
        if rank // ep == k:
            ep_group = g
    for j in range(ep):
        g = group([j + k * ep for k in range(dp)])
        if rank % ep == j:
            dp_group = g
    return Parallel(rank, world, ep, ep_group, dp_group)


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (this rank's slice); everything else is replicated."""
    return name.endswith(("experts.gate_up_proj", "experts.down_proj")) and "shared_experts" not in name


def _all_reduce_sum(tensors: list[torch.Tensor], group) -> None:
    """Sum fp32 tensors over ``group`` in flattened buckets (same order and sizes on every rank)."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        bucket, size = [], 0

    for t in tensors:
        bucket.append(t)
        size += t.numel()
        if size >= _BUCKET_ELEMENTS:
            flush()
    flush()


@torch.no_grad()
def reduce_gradients(named_grads: list[tuple[str, torch.Tensor]], par: Parallel) -> None:
    """In place: replicated grads summed over the world, expert grads over the DP group; both / W."""
    if par.world == 1:
        return
    replicated = [g for n, g in named_grads if not is_expert_param(n)]
    experts = [g for n, g in named_grads if is_expert_param(n)]
    _all_reduce_sum(replicated, dist.group.WORLD)
    if par.dp_group is not None:
        _all_reduce_sum(experts, par.dp_group)
    for g in replicated + experts:
        g.div_(par.world)


@torch.no_grad()
def clip_grad_norm(named_grads: list[tuple[str, torch.Tensor]], max_norm: float, par: Parallel) -> float:
    """Scale the (reduced) gradients so that the global norm is at most ``max_norm``; return the norm.

    Replicated gradients are equal on every rank after the reduction; expert gradients differ
    within an EP group, so their squares are summed over it. Every rank gets the same norm.
    """
    device = named_grads[0][1].device
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    for n, g in named_grads:
        sq = g.float().pow(2).sum()
        if is_expert_param(n):
            experts += sq
        else:
            replicated += sq
    if par.ep_group is not None:
        dist.all_reduce(experts, group=par.ep_group)
    norm = (replicated + experts).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for _, g in named_grads:
            g.mul_(scale)
    return float(norm)

