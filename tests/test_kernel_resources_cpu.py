"""The fused kernels, compiled for sm_90 on the CPU, keep their wgmma pipelined and fit in shared memory.

ptxas serializes every wgmma of a function when one loop of it breaks the pipeline (C7515)
or when the function runs out of registers (C7512). In a persistent kernel that one function
is every task, so a single change to a rarely run task can slow all GEMM tiles down. The
backward kernel shipped in that state once. This test compiles both kernels with the GPU's
tiles at the DeepSeek-V3 one-rank shape through benchmarks/kernel_resources.py (Triton's own
compiler and ptxas, no GPU) and fails on either warning or on shared memory over sm_90's
227 KB. A second run with weight-gradient tiles known to exhaust the registers shows that
the check does fail.
"""

import importlib.util
import json
import os
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
    done, report = run_tool(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("forward", "backward"):
        kernel = report["kernels"][name]
        assert kernel["wgmma_serialized"] == [], (name, kernel["ptxas_warnings"])
        assert 0 < kernel["shared_bytes"] <= 232448, (name, kernel["shared_bytes"])
        assert kernel["registers"] > 0


def test_register_starved_tiles_are_reported(tmp_path):
    done, report = run_tool(tmp_path, "--kernels", "backward", "--backward-tiles", "wgrad_cols=256", "wgrad_depth=32")
    assert done.returncode == 1 and "wgmma serialized (C7512)" in done.stdout, done.stdout[-3000:]
    assert report["kernels"]["backward"]["wgmma_serialized"] == ["C7512"]
