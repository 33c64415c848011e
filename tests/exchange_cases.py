"""The standalone exchange's test batches and what dispatch and combine must return for them,
written out per token (shared by the CPU and GPU exchange tests)."""

import torch

E, K, H = 8, 3, 24


def batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, H, generator=g) for n in counts]
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.zeros(0, K, dtype=torch.long)
           for n in counts]
    for i in idx:
        if len(i) > 2:
            i[1, -1] = -1  # a token with one choice fewer
    ws = [torch.rand(n, K, generator=g) for n in counts]
    return xs, idx, ws


def dispatched_rows(xs: list, idx: list, rank: int, world: int) -> list:
    """The rows rank ``rank`` receives, by definition: by local expert, then source rank, then
    source token, one row per (token, local expert) chosen."""
    local = E // world
    return [xs[s][t] for el in range(local) for s in range(world) for t in range(len(xs[s]))
            if (idx[s][t] == rank * local + el).any()]


def rows_per_local_expert(idx: list, rank: int, world: int) -> list[int]:
    """How many rows each of rank ``rank``'s experts receives."""
    local = E // world
    return [sum(int((idx[s] == rank * local + el).any(1).sum()) for s in range(len(idx))) for el in range(local)]


def combined_stand_in(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Combine's result for the stand-in experts ``y = 2 row + e`` (each expert output rounded to
    ``dtype``, as it travels): per token the weighted sum over its chosen experts, in fp32, and
    the sum of the terms' magnitudes (the scale of its rounding)."""
    ref = torch.zeros(len(x), x.shape[1], device=x.device)
    size = torch.zeros_like(ref)
    for t in range(len(x)):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                term = w[t, k] * (2 * x[t].float() + e).to(dtype).float()
                ref[t] += term
                size[t] += term.abs()
    return ref, size
