"""Standalone dispatch/combine and the DeepEP-compatible Buffer on the GPU.

The exchange runs in emulated worlds of 1, 2, 4 and 8 ranks on one GPU, in bf16 and fp32,
with a rank that sends nothing and tokens with an empty choice; the received rows must be
exactly the rows sent (a copy), and combine must match a per-token loop within the rounding
of its bf16 combine buffer (each weighted row, then the fp32 sum). The compat Buffer repeats the CPU test's DeepEP
semantics at world 1 on CUDA (a one-GPU machine has no second process with its own device).
"""

import pytest
import torch

from deepep_semantics import check_buffer
from exchange_cases import E, H, K, batch, combined_stand_in, dispatched_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_round_trip_in_emulated_world(world, dtype):
    from kosmos_moe.exchange import ExpertExchange
    from kosmos_moe.fabric import EmulatedWorld

    counts = [37, 0, 130, 5, 64, 1, 99, 12][:world]
    emulated = EmulatedWorld(world, "cuda")
    exchanges = [ExpertExchange(E, K, H, max(counts) + 3, emulated.rank(r)) for r in range(world)]
    L = E // world
    for call in range(3):  # epochs and both count-table parities
        xs, idx, ws = batch(counts, seed=call)
        xs = [x.to("cuda", dtype) for x in xs]
        idx = [i.cuda() for i in idx]
        ws = [w.cuda() for w in ws]
        sent = emulated.run(lambda r, x, i, w: exchanges[r].dispatch(x, i, w), xs, idx, ws)
        torch.cuda.synchronize()
        ys = []
        for rank, (rows, handle) in enumerate(sent):
            exchanges[rank].launch.raise_if_failed()
            expected = dispatched_rows(xs, idx, rank, world)
            n = int(handle.num_rows)
            assert n == len(expected)
            if n:
                assert torch.equal(rows[:n], torch.stack(expected))
            expert_of_row = rank * L + torch.repeat_interleave(torch.arange(L, device="cuda"), handle.tokens_per_expert)
            y = rows.clone()
            y[:n] = (2 * rows[:n].float() + expert_of_row[:, None]).to(dtype)
            ys.append(y)
        outs = emulated.run(lambda r, y, s: exchanges[r].combine(y, s[1]), ys, sent)
        torch.cuda.synchronize()
        for rank in range(world):
            ref, size = combined_stand_in(xs[rank], idx[rank], ws[rank], dtype)
            # Each weighted row is rounded to the row dtype in the combine buffer, then the fold
            # sums them in fp32 and rounds once more: at most one ulp (2^-7 of |v| in bf16, 8
            # significant bits) of every term and of the sum, even for truncating conversions.
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
            bound = ulp * (size + ref.abs()) + 1e-6
            err = (outs[rank].float() - ref).abs()
            assert (err <= bound).all(), f"world {world} rank {rank} call {call}: {(err - bound).max().item():.3g} over"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_buffer_matches_deepep_semantics_on_cuda(dtype):
    check_buffer(0, 1, [200], device="cuda", dtype=dtype)
