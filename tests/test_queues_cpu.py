"""The task lookups of kernels/queues.py under Triton's interpreter: ``locate_expert`` (one
reduction for an expert's four entries, Tiles.merged_lookup_from) against ``locate`` and four
``pick``s, for every task of a task kind with three tasks per row tile, over local experts
with and without rows."""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.queues import expert_tasks, locate, locate_expert, pick
from multiprocess import INTERPRET, run_world


# Decorated at import: in run_world's children, with TRITON_INTERPRET set, the interpreter's.
@triton.jit
def _lookups(table_ptr, out_ptr, n_tasks, EL_PAD: tl.constexpr, BM: tl.constexpr, N_A: tl.constexpr):
    """Row ``task`` of ``out``: ``locate`` and four ``pick``s, then ``locate_expert``, 6 values each."""
    idx = tl.arange(0, EL_PAD)
    table = tl.load(table_ptr + idx)[None, :]  # one source rank
    n_el, tiles_el, tile_start_el, row_start_el, cum, _, _, _ = expert_tasks(table, BM, N_A, 1)
    for task in range(n_tasks):
        e, first = locate(cum, idx, task)
        old = (e, first, pick(n_el, idx, e), pick(tiles_el, idx, e), pick(tile_start_el, idx, e),
               pick(row_start_el, idx, e))
        new = locate_expert(cum, idx, task, n_el, tiles_el, tile_start_el, row_start_el, N_A)
        for j in tl.static_range(6):
            tl.store(out_ptr + task * 12 + j, old[j])
            tl.store(out_ptr + task * 12 + 6 + j, new[j])


def check_lookups(rank, world, n_local, pad, rows_per_tile, per_tile):
    gen = torch.Generator().manual_seed(n_local)
    counts = torch.randint(0, 3 * rows_per_tile, (pad,), generator=gen, dtype=torch.int32)
    counts[n_local:] = 0
    counts[::5] = 0  # experts without rows between others
    tiles = (counts + rows_per_tile - 1) // rows_per_tile
    n_tasks = int(tiles.sum()) * per_tile
    out = torch.full((n_tasks, 12), -1, dtype=torch.int32)
    _lookups[(1,)](counts, out, n_tasks, pad, rows_per_tile, per_tile)
    assert n_tasks > 0 and (out >= 0).all()
    assert torch.equal(out[:, :6], out[:, 6:]), (out[:, :6] != out[:, 6:]).nonzero()[:5]
    # Every task lands on an expert with rows, in expert order, each expert's tasks together.
    experts = out[:, 0].long()
    assert (counts[experts] > 0).all() and (experts.diff() >= 0).all()
    assert torch.equal(torch.bincount(experts, minlength=pad), tiles.long() * per_tile)


@pytest.mark.parametrize("n_local, pad", [(6, 8), (200, 256)], ids=["8_lanes", "256_lanes"])
def test_merged_lookup_matches_locate_and_picks(n_local, pad):
    run_world(1, check_lookups, n_local, pad, 16, 3, env=INTERPRET)
