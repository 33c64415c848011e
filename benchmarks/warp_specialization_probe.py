"""Whether this Triton warp-specializes a TMA + wgmma GEMM loop for Hopper (sm_90a), offline.

CUTLASS's Hopper GEMMs (``torch._grouped_mm``'s) give the copies to a producer warpgroup; the
fused kernels issue them from the computing warps. Triton's ``tl.range(..., warp_specialize=True)``
asks the compiler for that split. This compiles the simplest such loop, bf16 operands by tensor
descriptor into an fp32 accumulator, in three settings: one tile per program (``one_tile``), a
persistent grid striding over tiles (``persistent``), and a self-scheduling loop that claims
tiles with an atomic ticket, as the fused kernels do (``claimed``); at each warp count and tile
shape asked for. Per build it prints whether the compiled TTGIR holds a ``ttg.warp_specialize``
(``split``), holds none (``not split``: the hint was dropped), or the compile failed (with the
pass's last error line). Needs no GPU:

    python benchmarks/warp_specialization_probe.py [--warps 4 8] [--tiles 64x128 128x256]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def _tile(a_desc, b_desc, c_ptr, N, K, t, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          WS: tl.constexpr):
    n_n = tl.cdiv(N, BN)
    om = (t // n_n) * BM
    on = (t % n_n) * BN
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, K, BK, num_stages=4, warp_specialize=WS):
        acc = tl.dot(a_desc.load([om, k]), b_desc.load([on, k]).T, acc)
    rows = om + tl.arange(0, BM)
    cols = on + tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def one_tile(a_desc, b_desc, c_ptr, head_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             WS: tl.constexpr):
    _tile(a_desc, b_desc, c_ptr, N, K, tl.program_id(0), BM, BN, BK, WS)


@triton.jit
def persistent(a_desc, b_desc, c_ptr, head_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               WS: tl.constexpr):
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        _tile(a_desc, b_desc, c_ptr, N, K, t, BM, BN, BK, WS)


@triton.jit
def claimed(a_desc, b_desc, c_ptr, head_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            WS: tl.constexpr):
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    t = tl.atomic_add(head_ptr, 1)
    while t < n_tiles:
        _tile(a_desc, b_desc, c_ptr, N, K, t, BM, BN, BK, WS)
        t = tl.atomic_add(head_ptr, 1)


KERNELS = {"one_tile": one_tile, "persistent": persistent, "claimed": claimed}


def probe(kernel, warps: int, bm: int, bn: int, bk: int = 64) -> str:
    """``split``, ``not split`` or ``failed in PASS: ERROR`` for one sm_90a build of ``kernel``."""
    signature = {"a_desc": f"tensordesc<bf16[{bm},{bk}]>", "b_desc": f"tensordesc<bf16[{bn},{bk}]>",
                 "c_ptr": "*bf16", "head_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "WS": "constexpr"}
    source = ASTSource(kernel, signature, constexprs={"BM": bm, "BN": bn, "BK": bk, "WS": True})
    # MLIR prints a failing pass's diagnostics to the process's stderr; the exception only says
    # that the pipeline failed. So stderr goes to a file for the compile.
    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        except Exception as e:  # noqa: BLE001 - the compiler's own error is the finding
            log.seek(0)
            text = log.read()
            errors = re.findall(r"error: (.*)", text) or [str(e).strip().splitlines()[-1]]
            failed_pass = re.findall(r"Pipeline failed while executing \[`(\w+)`", text)
            return f"failed in {failed_pass[0] if failed_pass else 'the compiler'}: {errors[0][:240]}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return "split" if re.search(r"ttg\.warp_specialize", compiled.asm["ttgir"]) else "not split"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--tiles", nargs="+", default=["64x128", "128x128", "128x256"], metavar="BMxBN")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90a, bf16 operands by tensor descriptor, 64 deep, 4 stages", flush=True)
    for name in args.kernels:
        for warps in args.warps:
            for tile in args.tiles:
                bm, bn = (int(v) for v in tile.split("x"))
                print(f"{name:10} {warps} warps {bm:3} x {bn:3}: {probe(KERNELS[name], warps, bm, bn)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
