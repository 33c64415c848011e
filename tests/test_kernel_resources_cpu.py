"""The fused kernels, compiled for sm_90 on the CPU, keep their wgmma pipelined and fit in shared memory.

ptxas serializes every wgmma of a function when one loop of it breaks the pipeline (C7515)
or when the function runs out of registers (C7512). In a persistent kernel that one function
is every task, so a single change to a rarely run task can slow all GEMM tiles down. The
backward kernel shipped in that state once. Separately, Triton makes every dot of a loop
synchronous when one operand is a plain load instead of an asynchronous copy, which the
forward's gate/up loop was until its rows were declared aligned.

This test compiles both kernels with the GPU's tiles at the DeepSeek-V3 one-rank shape
through benchmarks/kernel_resources.py (Triton's own compiler and ptxas, no GPU) and fails
on either warning, on a 16-bit wgmma loop without a dot in flight, on shared memory over
sm_90's 227 KB, or on fewer blocks per SM than the tiles' workers_per_sm; so does the
Qwen3-235B shape, where both kernels take their many-expert tiles. Three more runs
show the checks can fail: tiles known to exhaust the registers (the default wide dx and
SwiGLU-backward tiles beside flat weight-gradient strips), the forward
without its row alignment hint, and the default forward asked to run two workers per SM.
"""

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                                reason="this Triton has no NVIDIA backend (ptxas) to compile for sm_90")


def run_tool(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "resources.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--check",
                           "--out", str(out), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_default_tiles_keep_wgmma_pipelined(tmp_path):
    done, report = run_tool(tmp_path, "--spills", "5", "--sass-loops", "--kernels", "forward", "backward", "plain_gate_up")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # GEMM loops: forward routed and shared gate/up and down; backward dx, the SwiGLU
    # backward's g Wd (every row's projections kept at one rank) and the weight-gradient strip.
    for name, loops in (("forward", 4), ("backward", 3)):
        kernel = report["kernels"][name]
        assert kernel["wgmma_serialized"] == [], (name, kernel["ptxas_warnings"])
        assert 0 < kernel["shared_bytes"] <= 232448, (name, kernel["shared_bytes"])
        assert kernel["registers"] > 0
        assert kernel["code_bytes"] > 0 and kernel["code_bytes"] % 16 == 0, kernel["code_bytes"]  # sm_90 instructions
        assert kernel["warps"] == 8 and kernel["blocks_per_sm"] == 1, kernel  # the tiles' workers_per_sm
        gemm_loops = [loop for loop in kernel["wgmma_loops"] if loop["dtype"] == "bf16"]
        assert len(gemm_loops) >= loops and all(loop["in_flight"] for loop in gemm_loops), kernel["wgmma_loops"]
        # Spilled bytes are found at source lines of the kernels (--spills), at most 5 of them
        # (local-memory traffic that is not a spill may show up too).
        sites = kernel["spill_sites"]
        assert len(sites) <= 5 and (sites or kernel["spill_stores"] + kernel["spill_loads"] == 0), sites
        assert all(re.fullmatch(r"\w+\.py:\d+", s["line"]) and s["stores"] + s["loads"] > 0 for s in sites), sites
        # Every GEMM loop's machine code: four m64n256k16 products a 64-deep step per warpgroup;
        # the forward's loops reload nothing spilled (Triton 3.6's backward dx and SwiGLU-backward
        # loops reload one register a step, Triton 3.9's none).
        sass = kernel["sass_loops"]
        assert len(sass) >= loops and all(loop["HGMMA"] >= 4 for loop in sass), sass
        if name == "forward":
            assert all(loop["LDL"] + loop["STL"] == 0 for loop in sass), sass
            # Below 128 local experts the gate/up tiles (routed and shared) run 3 stages and the
            # down tiles 4 (Tiles.stages, Tiles.down_stages).
            assert sorted(loop["stages"] for loop in gemm_loops) == [3, 3, 4, 4], gemm_loops

    # The forward's routed gate/up loop compiles to the code of the same tile alone in a plain grid
    # (gemm_tiles.py, 729 TFLOP/s at stop 44 against about 630 in the fused kernel): the same
    # products, copies, waits and barriers a step, and no more than 20% more instructions. So what
    # the fused kernel loses there is not in the loop's code (stop 50). Since gate/up tickets are
    # claimed on pass (stop 51) ptxas builds the wgmma descriptors in ordinary registers and moves
    # them to uniform ones each step (R2UR 21 against 7): 146 instructions against the plain grid's
    # 127 under Triton 3.9, 145 against 114 under 3.6, in a kernel measured 4-9% faster for it.
    import kosmos_moe.kernels.tile_gemm as tile_gemm

    source, first = inspect.getsourcelines(tile_gemm.gate_up_pair_acc_tma.fn)
    body = range(first, first + len(source))

    def routed_gate_up(kernel):
        # The loop of gate_up_pair_acc_tma (whichever of its lines holds the most instructions).
        found = [loop for loop in report["kernels"][kernel]["sass_loops"]
                 if loop["source"].startswith("tile_gemm.py:") and int(loop["source"].split(":")[1]) in body]
        assert len(found) == 1, report["kernels"][kernel]["sass_loops"]
        return found[0]

    fused, plain = routed_gate_up("forward"), routed_gate_up("plain_gate_up")
    steps = ("HGMMA", "LDGSTS", "UTMALDG", "DEPBAR", "SYNCS", "BAR")
    assert {op: fused[op] for op in steps} == {op: plain[op] for op in steps}, (fused, plain)
    assert fused["LDGSTS"] > 0 and fused["UTMALDG"] > 0  # rows by pointer copies, weights by the copy engine
    assert plain["instructions"] <= fused["instructions"] <= 1.2 * plain["instructions"], (fused, plain)


def test_many_expert_tiles_compile_as_chosen(tmp_path):
    # From 128 local experts (Qwen3 at EP=1) the forward's gate/up tiles run 4 stages instead of 3
    # (Tiles.many_experts_stages) beside the down tiles' 4, and the backward runs as two workers
    # of one warpgroup per SM (kosmos_moe.workspace.gpu_backward_tiles): both still with one dot
    # in flight, without serialized wgmma and within shared memory (--check), two backward blocks
    # resident per SM.
    done, report = run_tool(tmp_path, "--case", "qwen3_full", "--kernels", "forward", "backward")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    forward, backward = report["kernels"]["forward"], report["kernels"]["backward"]
    gemm_loops = [loop for loop in forward["wgmma_loops"] if loop["dtype"] == "bf16"]
    assert len(gemm_loops) >= 3 and {loop["stages"] for loop in gemm_loops} == {4}, gemm_loops
    assert backward["warps"] == 4 and backward["blocks_per_sm"] == 2, backward
    assert backward["wgmma_serialized"] == [], backward["ptxas_warnings"]
    gemm_loops = [loop for loop in backward["wgmma_loops"] if loop["dtype"] == "bf16"]
    assert len(gemm_loops) >= 3 and all(loop["in_flight"] for loop in gemm_loops), gemm_loops


def test_register_starved_tiles_are_reported(tmp_path):
    # The default 256-column dx and SwiGLU-backward tiles beside weight-gradient strips reduced
    # in one flat loop (the default loop per block leaves room for them).
    done, report = run_tool(tmp_path, "--kernels", "backward", "--backward-tiles", "wgrad_block_loops=false")
    assert done.returncode == 1 and "wgmma serialized (C7512)" in done.stdout, done.stdout[-3000:]
    assert report["kernels"]["backward"]["wgmma_serialized"] == ["C7512"]


def test_unaligned_gate_up_rows_are_reported(tmp_path):
    done, report = run_tool(tmp_path, "--kernels", "forward", "--tiles", "row_alignment_hint=false")
    assert done.returncode == 1 and "waits for every dot" in done.stdout, done.stdout[-3000:]
    stalled = [loop for loop in report["kernels"]["forward"]["wgmma_loops"]
               if loop["dtype"] == "bf16" and not loop["in_flight"]]
    # The routed gate/up loop: one dot of both weight blocks (Tiles.gate_up_one_dot).
    assert len(stalled) == 1 and stalled[0]["dots"] == 1 and stalled[0]["plain_loads"] == 1, stalled


def test_more_workers_per_sm_than_fit_are_reported(tmp_path):
    # The default forward (8 warps, ~147 KB of shared memory) fits one block per SM; the
    # launcher would refuse a grid of two per SM, and the offline check says so first.
    done, report = run_tool(tmp_path, "--kernels", "forward", "--tiles", "workers_per_sm=2")
    assert done.returncode == 1 and "2 workers per SM asked, 1 fit" in done.stdout, done.stdout[-3000:]
    assert report["kernels"]["forward"]["blocks_per_sm"] == 1
