"""The expert-GEMM tiles (kernels/tile_gemm.py) under Triton's interpreter, fp32, against torch.

The tiles run from benchmarks/gemm_tiles.py's plain grids (one program per output tile), on
expert-major rows of three experts whose widths are no multiple of the 16-wide interpreter
tiles: a TMA weight block then runs past its expert's gate rows into the up rows, past an
expert into the next one, and past the last expert into the descriptor's zero fill, and the
masked stores must leave none of that in the result.
"""

import sys
from pathlib import Path

import pytest

from multiprocess import INTERPRET, run_world


def check_tiles(rank, world, tma):
    import torch
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gemm_tiles as g

    torch.manual_seed(0)
    H, I, E, T, K = 48, 40, 3, 20, 2
    BM = BN = BK = 16
    x = torch.randn(T, H)
    experts = torch.rand(T, E).topk(K, dim=1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    token_of_row = (order // K).to(torch.int32)
    counts = torch.bincount(experts, minlength=E)
    rows = x[token_of_row.long()].contiguous()
    R = rows.shape[0]
    w_gate_up = torch.randn(E, 2 * I, H)
    w_down = torch.randn(E, H, I)
    h_ref, y_ref = torch.empty(R, I), torch.empty(R, H)
    start = 0
    for e, c in enumerate(counts.tolist()):
        gu = rows[start:start + c] @ w_gate_up[e].T
        h_ref[start:start + c] = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        y_ref[start:start + c] = h_ref[start:start + c] @ w_down[e].T
        start += c
    row0, n_rows, ex = g.tiles_of(counts, BM)
    nt = row0.numel()
    gu_grid, dn_grid = (nt * triton.cdiv(I, BN),), (nt * triton.cdiv(H, BN),)
    results = {}
    # one_dot: gate and up blocks side by side in one dot (a 3-D descriptor [2E, I, H] by TMA),
    # where a block past I must read the descriptor's zero fill, not the up rows.
    for gather, one_dot in ((True, False), (False, False), (True, True), (False, True)):
        h = torch.zeros(R, I)
        if tma:
            w_desc = (TensorDescriptor.from_tensor(w_gate_up.view(2 * E, I, H), [2, BN, BK]) if one_dot
                      else TensorDescriptor.from_tensor(w_gate_up.view(-1, H), [BN, BK]))
            g._gate_up_grid_tma[gu_grid](
                x if gather or not one_dot else rows, TensorDescriptor.from_tensor(rows, [BM, BK]), token_of_row,
                row0, n_rows, ex, nt, w_desc, h, H, I, BM, BN, BK, 1, gather, tl.float32, one_dot)
        else:
            g._gate_up_grid[gu_grid](x if gather else rows, token_of_row, row0, n_rows, ex, nt, w_gate_up, h,
                                     H, I, BM, BN, BK, 1, gather, tl.float32, one_dot)
        results[f"gate/up, gathered rows {gather}, one dot {one_dot}"] = (h, h_ref)
    for rows_by_tma in ((False, True) if tma else (False,)):
        y = torch.zeros(R, H)
        if tma:
            g._down_grid_tma[dn_grid](
                h_ref, TensorDescriptor.from_tensor(h_ref, [BM, BK]), row0, n_rows, ex, nt,
                TensorDescriptor.from_tensor(w_down.view(-1, I), [BN, BK]), y, H, I, BM, BN, BK, 1, tl.float32,
                rows_by_tma)
        else:
            g._down_grid[dn_grid](h_ref, row0, n_rows, ex, nt, w_down, y, H, I, BM, BN, BK, 1, tl.float32)
        results[f"down, rows by TMA {rows_by_tma}"] = (y, y_ref)
    for what, (got, want) in results.items():
        # fp32 dot products of at most 48 terms of O(1): a few ulps of the largest entries.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"{what} (tma={tma}): {m}")


@pytest.mark.parametrize("tma", [False, True], ids=["pointer_weights", "tma_weights"])
def test_tiles_match_torch(tma):
    run_world(1, check_tiles, tma, env=INTERPRET)


def check_weight_gradient_strips(rank, world, tma):
    import torch
    import triton.language as tl

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gemm_tiles as g

    torch.manual_seed(0)
    # Expert 1 has no rows (its gradient must be written as zeros over the garbage below);
    # 37 and 21 rows leave partial 16-row steps; M = 40 and N = 72 leave partial 16-wide row
    # and column blocks (a TMA store must clip them, not spill into the next expert) and
    # strips of two blocks with a partial last strip.
    counts = torch.tensor([37, 0, 21])
    M, N = 40, 72
    a, b = torch.randn(int(counts.sum()), M), torch.randn(int(counts.sum()), N)
    out = torch.full((3, M, N), float("nan"))
    variant = (16, 16, 16, 1, 2, 1, tma != "pointers", tma == "tma_store", tma == "block_loops",
               tma == "block_loops")
    g.wgrad_launch(a, b, out, counts, variant, tl.float32)()
    want = torch.stack([a[:37].T @ b[:37], torch.zeros(M, N), a[37:].T @ b[37:]])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


# block_loops: TMA loads, each block its own pipelined loop instead of one flat loop, stored
# with an evict-first hint.
@pytest.mark.parametrize("tma", ["pointers", "tma_loads", "tma_store", "block_loops"])
def test_weight_gradient_strips_match_torch(tma):
    run_world(1, check_weight_gradient_strips, tma, env=INTERPRET)
