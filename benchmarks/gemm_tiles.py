"""The expert-GEMM tiles of the fused kernels on their own, against ``torch._grouped_mm``.

The fused forward runs its expert GEMMs through ``kernels/tile_gemm.py`` from inside a
persistent kernel. This script launches the same tile functions from a plain grid (one program
per output tile, no queues, no communication) on the rows the layer would see, so that the
tile code's own rate can be told apart from what the persistent kernel around it costs.

    python benchmarks/gemm_tiles.py --out gemm_tiles.json

For each shape and tile variant: gate/up and down TFLOP/s with gathered rows (as the fused
kernel reads its own rank's rows in place) and with contiguous rows, next to
``torch._grouped_mm`` on the same rows, and the largest difference from it.

The backward's weight gradients (``--wgrad-variants``) are reductions over each expert's
rows: ``dW[g;u] = [dg du]^T x`` and ``dWd = g^T (w h)``, run by ``row_reduction_strip`` (one
program per expert, row block of the output and strip of column blocks, as the fused
backward's tasks), next to ``torch._grouped_mm`` grouped along the reduction.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from common import require_cuda
from layer_forward import timed

from triton.tools.tensor_descriptor import TensorDescriptor

from kosmos_moe.kernels.tile_gemm import (
    down_tile, down_tile_tma, down_tile_tma_w, gate_up_pair_acc, gate_up_pair_acc_tma, gate_up_tile, gate_up_tile_tma,
    gate_up_tile_tma_rows, row_reduction_strip, store_swiglu,
)

SHAPES = {
    # name: (hidden, intermediate, experts, tokens, top_k)
    "dsv3_rank": (7168, 2048, 32, 4096, 8),
    "qwen3_rank": (4096, 1536, 16, 4096, 8),
    # All experts at EP=1: about 128 rows per expert, so a weight-gradient block is two row
    # steps and its store weighs as much as its math.
    "dsv3_full": (7168, 2048, 256, 4096, 8),
    # About 256 rows per expert: four row steps a weight-gradient block.
    "qwen3_full": (4096, 1536, 128, 4096, 8),
}

# (rows, gate/up columns, down columns, depth, stages, warps, weights by TMA: tile_gemm's *_tma
# tiles, gate/up as one dot of twice the columns: tile_gemm.gate_up_pair_acc*)
VARIANTS = {
    "fused_default": (128, 128, 128, 64, 3, 8, False, False),
    "down256": (128, 128, 256, 64, 3, 8, False, False),
    "stages4": (128, 128, 128, 64, 4, 8, False, False),
    "gu64_down256_s4": (128, 64, 256, 64, 4, 8, False, False),
    "bk128_s2": (128, 128, 128, 128, 2, 8, False, False),
    "rows64_w4": (64, 128, 128, 64, 4, 4, False, False),
    "tma_default": (128, 128, 128, 64, 3, 8, True, False),
    "tma_down256": (128, 128, 256, 64, 3, 8, True, False),
    "tma_stages4": (128, 128, 256, 64, 4, 8, True, False),
    "tma_gu64_s4": (128, 64, 256, 64, 4, 8, True, False),
    "tma_w4": (128, 64, 128, 64, 4, 4, True, False),
    "one_dot": (128, 128, 256, 64, 3, 8, False, True),
    "tma_one_dot": (128, 128, 256, 64, 3, 8, True, True),
}

# Weight-gradient tiles: (output rows, output columns, reduction depth, stages, column blocks
# per strip, warps, operands by TMA, blocks stored by TMA, each block its own loop instead of
# one flat loop over the strip, blocks stored with an L2 evict-first policy). The fused
# backward's (GPU_BACKWARD_TILES' wgrad_* fields) are cols256_block_loops_evict since stop 42
# (4 stages; cols256_block_loops with 4 stages since stop 34, cols256 since stop 32, cols128
# before); the other cols128-sized ones change one thing of cols128, and cols256_block_loops
# one thing of cols256.
WGRAD_VARIANTS = {
    "cols128": (128, 128, 64, 4, 16, 8, True, False, False, False),
    "pointers": (128, 128, 64, 4, 16, 8, False, False, False, False),
    "pointers_stages3": (128, 128, 64, 3, 16, 8, False, False, False, False),
    "cols256": (128, 256, 64, 3, 16, 8, True, False, False, False),
    "rows256": (256, 128, 64, 3, 16, 8, True, False, False, False),
    "cols256_pointers": (128, 256, 64, 3, 16, 8, False, False, False, False),
    "strip4": (128, 128, 64, 4, 4, 8, True, False, False, False),
    "tma_store": (128, 128, 64, 4, 16, 8, True, True, False, False),
    "cols256_block_loops": (128, 256, 64, 3, 16, 8, True, False, True, False),
    "cols256_block_loops_evict": (128, 256, 64, 4, 16, 8, True, False, True, True),
}


@triton.jit
def _task(tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles):
    """This program's (column block, first row, row count, expert); the row tile runs fastest, so
    that programs running together share one weight block."""
    pid = tl.program_id(0)
    t = pid % n_tiles
    return pid // n_tiles, tl.load(tile_row0_ptr + t), tl.load(tile_rows_ptr + t), tl.load(tile_expert_ptr + t)


@triton.jit
def _store_rows(acc, y_ptr, row0, n_rows, n0, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Store a down tile ``acc`` at rows ``row0 + [0, n_rows)`` and columns ``n0 + [0, BN)`` of ``y``."""
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    dst = y_ptr + (row0 + rows).to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=(rows < n_rows)[:, None] & (cols < H)[None, :])


@triton.jit
def _gate_up_grid(x_ptr, token_of_row_ptr, tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles,
                  w_gate_up_ptr, h_ptr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, STAGES: tl.constexpr, GATHER: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  ONE_DOT: tl.constexpr = False):
    ib, row0, n_rows, e = _task(tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles)
    rows = row0 + tl.arange(0, BM)
    if GATHER:
        tok = tl.load(token_of_row_ptr + rows, mask=tl.arange(0, BM) < n_rows, other=0)
        a_rows = x_ptr + tok.to(tl.int64) * H
    else:
        a_rows = x_ptr + rows.to(tl.int64) * H
    w_e = w_gate_up_ptr + e.to(tl.int64) * 2 * I * H
    if ONE_DOT:
        acc_g, acc_u = gate_up_pair_acc(a_rows, n_rows, w_e, ib * BN, H, I, BM, BN, BK, DOT_DTYPE, STAGES)
        store_swiglu(acc_g, acc_u, h_ptr + row0.to(tl.int64) * I, tl.arange(0, BM), ib * BN + tl.arange(0, BN),
                     tl.arange(0, BM) < n_rows, I)
    else:
        gate_up_tile(a_rows, n_rows, w_e, w_e + I * H, h_ptr + row0.to(tl.int64) * I, ib * BN,
                     H, I, BM, BN, BK, DOT_DTYPE, STAGES)


@triton.jit
def _down_grid(h_ptr, tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles, w_down_ptr, y_ptr,
               H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    hb, row0, n_rows, e = _task(tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles)
    acc = down_tile(h_ptr + row0.to(tl.int64) * I, n_rows, w_down_ptr + e.to(tl.int64) * H * I, hb * BN,
                    I, H, BM, BN, BK, DOT_DTYPE, STAGES)
    _store_rows(acc, y_ptr, row0, n_rows, hb * BN, H, BM, BN)


@triton.jit
def _gate_up_grid_tma(x_ptr, x_desc, token_of_row_ptr, tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles,
                      w_desc, h_ptr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, STAGES: tl.constexpr, GATHER: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      ONE_DOT: tl.constexpr = False):
    """With ``ONE_DOT``, ``w_desc`` is ``[2 E, I, H]`` with block ``[2, BN, BK]`` and the rows are
    read by pointers, gathered or not, as in the fused kernel."""
    ib, row0, n_rows, e = _task(tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles)
    h_rows = h_ptr + row0.to(tl.int64) * I
    if ONE_DOT:
        rows = row0 + tl.arange(0, BM)
        if GATHER:
            rows = tl.load(token_of_row_ptr + rows, mask=tl.arange(0, BM) < n_rows, other=0)
        acc_g, acc_u = gate_up_pair_acc_tma(x_ptr + rows.to(tl.int64) * H, n_rows, w_desc, 2 * e, ib * BN, H, BM, BN,
                                            BK, DOT_DTYPE, STAGES)
        store_swiglu(acc_g, acc_u, h_rows, tl.arange(0, BM), ib * BN + tl.arange(0, BN), tl.arange(0, BM) < n_rows, I)
    elif GATHER:
        tok = tl.load(token_of_row_ptr + row0 + tl.arange(0, BM), mask=tl.arange(0, BM) < n_rows, other=0)
        gate_up_tile_tma(x_ptr + tok.to(tl.int64) * H, n_rows, w_desc, e * 2 * I, w_desc, e * 2 * I + I, h_rows, ib * BN,
                         H, I, BM, BN, BK, DOT_DTYPE, STAGES)
    else:
        gate_up_tile_tma_rows(x_desc, row0, n_rows, w_desc, e * 2 * I, e * 2 * I + I, h_rows, ib * BN,
                              H, I, BM, BN, BK, DOT_DTYPE, STAGES)


@triton.jit
def _down_grid_tma(h_ptr, h_desc, tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles, w_desc, y_ptr,
                   H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, ROWS_BY_TMA: tl.constexpr):
    hb, row0, n_rows, e = _task(tile_row0_ptr, tile_rows_ptr, tile_expert_ptr, n_tiles)
    if ROWS_BY_TMA:
        acc = down_tile_tma(h_desc, row0, w_desc, e * H, hb * BN, I, BK, BM, BN, DOT_DTYPE, STAGES)
    else:
        acc = down_tile_tma_w(h_ptr + row0.to(tl.int64) * I, n_rows, w_desc, e * H, hb * BN, I, BM, BN, BK,
                              DOT_DTYPE, STAGES)
    _store_rows(acc, y_ptr, row0, n_rows, hb * BN, H, BM, BN)


@triton.jit
def _wgrad_grid(a_ptr, b_ptr, out_ptr, row_start_ptr, counts_ptr, M_DIM, N_DIM, n_m, n_s,
                STRIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                DOT_DTYPE: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr,
                BLOCK_LOOPS: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """``out[e, m-block, strip] = a[rows of e, m-block]^T @ b[rows of e, strip]``, in the fused
    backward's task order (expert, row block, strip)."""
    pid = tl.program_id(0)
    e = pid // (n_m * n_s)
    mb = (pid // n_s) % n_m
    sb = pid % n_s
    r0 = tl.load(row_start_ptr + e).to(tl.int64)
    row_reduction_strip(a_ptr + r0 * M_DIM, b_ptr + r0 * N_DIM, out_ptr + e.to(tl.int64) * M_DIM * N_DIM,
                        tl.load(counts_ptr + e), mb * BM, sb * STRIP, M_DIM, N_DIM, STRIP, BM, BN, BK, DOT_DTYPE,
                        STAGES, (M_DIM % 16 == 0) & (N_DIM % 16 == 0), TMA, TMA_STORE, BLOCK_LOOPS,
                        EVICT_FIRST=EVICT_FIRST)


def wgrad_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, counts: torch.Tensor, variant: tuple,
                 dot_dtype=tl.bfloat16):
    """A launcher of ``_wgrad_grid`` over expert-major rows ``a`` [R, M] and ``b`` [R, N] into ``out`` [E, M, N]."""
    bm, bn, bk, stages, strip, warps, tma, tma_store, block_loops, evict = variant
    M, N = a.shape[1], b.shape[1]
    n_m, n_s = triton.cdiv(M, bm), triton.cdiv(triton.cdiv(N, bn), strip)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    counts = counts.to(torch.int32)
    grid = (counts.numel() * n_m * n_s,)
    if tma and a.is_cuda:
        from kosmos_moe.fused import ensure_triton_allocator

        ensure_triton_allocator()
    return lambda: _wgrad_grid[grid](a, b, out, starts, counts, M, N, n_m, n_s, strip, bm, bn, bk, stages, dot_dtype,
                                     tma, tma_store, block_loops, evict, num_warps=warps)


def tiles_of(counts: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row tile: first row, row count and expert, for expert-major rows with ``counts`` each."""
    starts = torch.cumsum(counts, 0) - counts
    row0, n, ex = [], [], []
    for e, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):
        for m in range(0, c, bm):
            row0.append(s + m)
            n.append(min(bm, c - m))
            ex.append(e)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=counts.device)  # noqa: E731
    return as_t(row0), as_t(n), as_t(ex)


def report(name: str, label: str, res: dict) -> None:
    print(f"[{name}/{label}] gate/up gather {res['gate_up_gather']:.0f}, contiguous "
          f"{res['gate_up_contiguous']:.0f}, down {res['down']:.0f}"
          + (f" (rows by TMA {res['down_rows_tma']:.0f})" if "down_rows_tma" in res else "") + " TFLOP/s "
          f"(max diff h {res['h_max_diff']:.3g}, y {res['y_max_diff']:.3g})", file=sys.stderr, flush=True)


def run_wgrad(name: str, variants: dict) -> dict:
    """TFLOP/s of both weight gradients of one shape per variant, and of ``torch._grouped_mm``."""
    H, I, E, T, K = SHAPES[name]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    counts = torch.bincount(torch.rand(T, E, device=dev).topk(K, dim=1).indices.reshape(-1), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    R = int(counts.sum())
    x, dgu = torch.randn(R, H, device=dev, dtype=dt), torch.randn(R, 2 * I, device=dev, dtype=dt)
    g, hw = torch.randn(R, H, device=dev, dtype=dt), torch.randn(R, I, device=dev, dtype=dt)
    grads = {"d_gate_up": (dgu, x), "d_down": (g, hw)}
    out = {"shape": name, "rows": R, "variants": {}}
    refs = {}
    for key, (a, b) in grads.items():
        flops = 2 * R * a.shape[1] * b.shape[1]
        refs[key] = torch._grouped_mm(a.t(), b, offs=offs)
        out[f"grouped_mm_{key}_tflops"] = flops / timed(lambda: torch._grouped_mm(a.t(), b, offs=offs)) / 1e12
    print(f"[{name}] weight gradients, {R} rows: grouped_mm d_gate_up {out['grouped_mm_d_gate_up_tflops']:.0f}, "
          f"d_down {out['grouped_mm_d_down_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)
    for label, variant in variants.items():
        res = {}
        for key, (a, b) in grads.items():
            got = torch.empty_like(refs[key])
            launch = wgrad_launch(a, b, got, counts, variant)
            launch()
            torch.cuda.synchronize()
            res[f"{key}_tflops"] = 2 * R * a.shape[1] * b.shape[1] / timed(launch) / 1e12
            # Per group of experts: at 256 experts one gradient in fp32 is 30 GB.
            res[f"{key}_max_diff"] = max((got[i:i + 16].float() - refs[key][i:i + 16].float()).abs().max().item()
                                         for i in range(0, E, 16))
        out["variants"][label] = res
        print(f"[{name}/wgrad {label}] d_gate_up {res['d_gate_up_tflops']:.0f}, d_down {res['d_down_tflops']:.0f} "
              f"TFLOP/s (max diff {res['d_gate_up_max_diff']:.3g}, {res['d_down_max_diff']:.3g})",
              file=sys.stderr, flush=True)
    return out


def run_shape(name: str, variants: dict) -> dict:
    H, I, E, T, K = SHAPES[name]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=dt)
    experts = torch.rand(T, E, device=dev).topk(K, dim=1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    token_of_row = (order // K).to(torch.int32)
    counts = torch.bincount(experts, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x.index_select(0, token_of_row.long())
    w_gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    w_down = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    R = rows.shape[0]
    flops_gu, flops_dn = 2 * R * H * 2 * I, 2 * R * I * H

    gu_ref = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs)
    h_ref = (torch.nn.functional.silu(gu_ref[:, :I]) * gu_ref[:, I:]).contiguous()
    y_ref = torch._grouped_mm(h_ref, w_down.transpose(-2, -1), offs=offs)
    t_gu = timed(lambda: torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs))
    t_dn = timed(lambda: torch._grouped_mm(h_ref, w_down.transpose(-2, -1), offs=offs))
    out = {"shape": name, "rows": R, "grouped_mm_gate_up_tflops": flops_gu / t_gu / 1e12,
           "grouped_mm_down_tflops": flops_dn / t_dn / 1e12, "variants": {}}
    print(f"[{name}] {R} rows; grouped_mm gate/up {out['grouped_mm_gate_up_tflops']:.0f} TFLOP/s, "
          f"down {out['grouped_mm_down_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)

    def measure(launch, flops, got, want):
        """TFLOP/s of ``launch`` and the largest difference of its result from ``want``."""
        launch()
        torch.cuda.synchronize()
        return flops / timed(launch) / 1e12, (got.float() - want.float()).abs().max().item()

    for label, (bm, bn_gu, bn_dn, bk, stages, warps, tma, one_dot) in variants.items():
        row0, n_rows, ex = tiles_of(counts, bm)
        nt = row0.numel()
        gu_grid, dn_grid = (nt * triton.cdiv(I, bn_gu),), (nt * triton.cdiv(H, bn_dn),)
        h = torch.empty(R, I, device=dev, dtype=dt)
        y = torch.empty(R, H, device=dev, dtype=dt)
        if tma:
            w_gu_desc = (TensorDescriptor.from_tensor(w_gate_up.view(2 * E, I, H), [2, bn_gu, bk]) if one_dot
                         else TensorDescriptor.from_tensor(w_gate_up.view(E * 2 * I, H), [bn_gu, bk]))
            w_dn_desc = TensorDescriptor.from_tensor(w_down.view(E * H, I), [bn_dn, bk])
            rows_desc = TensorDescriptor.from_tensor(rows, [bm, bk])
            h_desc = TensorDescriptor.from_tensor(h_ref, [bm, bk])
        res = {}
        for gather in (True, False):
            if tma:
                launch = lambda: _gate_up_grid_tma[gu_grid](  # noqa: E731
                    x if gather or not one_dot else rows, rows_desc, token_of_row, row0, n_rows, ex, nt, w_gu_desc, h,
                    H, I, bm, bn_gu, bk, stages, gather, tl.bfloat16, one_dot, num_warps=warps)
            else:
                launch = lambda: _gate_up_grid[gu_grid](  # noqa: E731
                    x if gather else rows, token_of_row, row0, n_rows, ex, nt, w_gate_up, h, H, I, bm, bn_gu, bk,
                    stages, gather, tl.bfloat16, one_dot, num_warps=warps)
            res["gate_up_gather" if gather else "gate_up_contiguous"], res["h_max_diff"] = measure(
                launch, flops_gu, h, h_ref)
        for rows_by_tma in ((False, True) if tma else (False,)):
            if tma:
                launch = lambda: _down_grid_tma[dn_grid](  # noqa: E731
                    h_ref, h_desc, row0, n_rows, ex, nt, w_dn_desc, y, H, I, bm, bn_dn, bk, stages, tl.bfloat16,
                    rows_by_tma, num_warps=warps)
            else:
                launch = lambda: _down_grid[dn_grid](  # noqa: E731
                    h_ref, row0, n_rows, ex, nt, w_down, y, H, I, bm, bn_dn, bk, stages, tl.bfloat16, num_warps=warps)
            res["down_rows_tma" if rows_by_tma else "down"], res["y_max_diff"] = measure(launch, flops_dn, y, y_ref)
        out["variants"][label] = res
        report(name, label, res)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--wgrad-variants", nargs="*", default=list(WGRAD_VARIANTS), choices=list(WGRAD_VARIANTS),
                   help="weight-gradient tile variants (none: skip the weight gradients)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    require_cuda("gemm_tiles.py")
    results = [run_shape(s, {v: VARIANTS[v] for v in args.variants}) for s in args.shapes if args.variants]
    wgrad = [run_wgrad(s, {v: WGRAD_VARIANTS[v] for v in args.wgrad_variants})
             for s in args.shapes if args.wgrad_variants]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shapes": results, "weight_gradients": wgrad}, f,
                      indent=1)


if __name__ == "__main__":
    main()
