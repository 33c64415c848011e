"""Standalone dispatch and combine under Triton's interpreter, in worlds of 1, 2 and 4 processes.

The received rows are checked against their definition (local expert, then source rank,
then source token), and combine against a per-token loop over the choices, with some choices
left empty (-1) and a rank without tokens.
"""

import pytest
import torch
import torch.distributed as dist

from exchange_cases import E, H, K, batch, combined_stand_in, dispatched_rows, rows_per_local_expert
from multiprocess import INTERPRET, run_world



def make_exchange(rank, world, max_tokens):
    from kosmos_moe.exchange import ExpertExchange
    from kosmos_moe.fabric import EmulatedWorld, SharedFileFabric

    fabric = SharedFileFabric(dist.group.WORLD) if world > 1 else EmulatedWorld(1, "cpu").rank(0)
    return ExpertExchange(E, K, H, max_tokens, fabric, workers=2)


def check_round_trip(rank, world, counts):
    ex = make_exchange(rank, world, max(counts) + 2)
    L = E // world
    for call in range(2):  # the second call runs on the next epoch and parity
        xs, idx, ws = batch(counts, seed=call)
        rows, handle = ex.dispatch(xs[rank], idx[rank], ws[rank])
        expected = dispatched_rows(xs, idx, rank, world)
        n = int(handle.num_rows)
        assert n == len(expected)
        if n:
            torch.testing.assert_close(rows[:n], torch.stack(expected), rtol=0, atol=0)
        assert handle.tokens_per_expert.tolist() == rows_per_local_expert(idx, rank, world)
        # A stand-in for the experts: y = 2 * row + global expert id.
        expert_of_row = rank * L + torch.repeat_interleave(torch.arange(L), handle.tokens_per_expert)
        y = rows.clone()
        y[:n] = 2 * rows[:n] + expert_of_row[:, None].float()
        out = ex.combine(y, handle)
        ref, _ = combined_stand_in(xs[rank], idx[rank], ws[rank], torch.float32)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_round_trip(world):
    run_world(world, check_round_trip, [13, 0, 21, 5][:world], env=INTERPRET)


def test_exchange_workspace_holds_no_gradient_rows():
    """The exchange shares the backward kernel's dispatch and layout but moves no output
    gradients: its workspace leaves out at least the ``R x H`` gradient rows (at DeepSeek-V3,
    W = 8, T = 16384: 15 of 32 GB). The round trips above run in that smaller workspace."""
    from kosmos_moe.config import MoEConfig
    from kosmos_moe.workspace import GPU_BACKWARD_TILES, backward_layout

    config = MoEConfig(hidden_size=7168, moe_intermediate_size=16, num_experts=256, top_k=8)
    full, rows_only = (backward_layout(config, 8, 16384, GPU_BACKWARD_TILES, torch.bfloat16, rows_only=r)
                       for r in (False, True))
    assert rows_only.recv_rows == full.recv_rows == 8 * 16384 * 8
    assert full.nbytes - rows_only.nbytes >= full.recv_rows * 7168 * 2
    assert rows_only.nbytes < 18 * 2**30, rows_only.nbytes


def check_bad_calls(rank, world):
    from kosmos_moe.fused import ExpertLayerTimeout

    ex = make_exchange(rank, world, 8)
    x, idx, w = torch.randn(4, H), torch.randint(0, E, (4, K)), torch.rand(4, K)
    with pytest.raises(ValueError, match="topk_idx and topk_weights must be"):
        ex.dispatch(x, idx[:, :2], w)
    with pytest.raises(ValueError, match="9 tokens on rank 0"):
        ex.dispatch(torch.randn(9, H), torch.randint(0, E, (9, K)), torch.rand(9, K))
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(4)])
    rows, old = ex.dispatch(x, idx, w)
    rows, handle = ex.dispatch(x, idx, w)
    with pytest.raises(RuntimeError, match="belongs to an earlier dispatch"):
        ex.combine(rows, old)
    with pytest.raises(TypeError, match="combine moves torch.float32"):
        ex.combine(rows.double(), handle)
    with pytest.raises(ExpertLayerTimeout, match="given 3 expert-output rows, but 12 rows were dispatched"):
        ex.combine(rows[:3], handle)


def test_bad_calls_are_refused():
    run_world(1, check_bad_calls, env=INTERPRET)
