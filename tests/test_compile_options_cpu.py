"""The kernels ask Triton for FP fusion themselves rather than take its default.

Triton 3.9 warns that its default turns from fusing ``a * b + c`` into one FMA to not fusing
in 3.10, which would change the kernels' code, speed and rounding under a newer Triton
without any change here. The launch keywords of both fused kernels carry
``enable_fp_fusion=True``; this test checks that they do, and that those keywords, used as
compile options, give an FMA for a multiply-add where Triton's default is set to off (and
that without them the same compile has none, so the check can fail).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kosmos_moe.workspace import COMPILE_OPTIONS, GPU_BACKWARD_TILES, GPU_TILES

ROOT = Path(__file__).resolve().parent.parent

# Compiled, not interpreted, for sm_90 with Triton's default fusion switched off; prints the PTX.
_COMPILE = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def multiply_add(a, b, c, out):
    tl.store(out, tl.load(a) * tl.load(b) + tl.load(c))

options = json.loads(sys.argv[1])
signature = {name: "*fp32" for name in ("a", "b", "c", "out")}
compiled = triton.compile(ASTSource(multiply_add, signature, constexprs={}),
                          target=GPUTarget("cuda", 90, 64), options=options)
print(compiled.asm["ptx"])
"""


def _ptx(tmp_path: Path, options: dict) -> str:
    script = tmp_path / "multiply_add.py"  # a file: Triton reads a kernel's source
    script.write_text(_COMPILE)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script), json.dumps(options)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_launch_keywords_ask_for_fp_fusion():
    for constants in (GPU_TILES.kernel_constants(local_experts=32), GPU_BACKWARD_TILES.kernel_constants(hidden=7168)):
        assert constants["enable_fp_fusion"] is True
        assert COMPILE_OPTIONS <= constants.keys()


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="this Triton has no NVIDIA backend to compile for sm_90")
def test_launch_options_fuse_where_triton_would_not(tmp_path):
    constants = GPU_TILES.kernel_constants(local_experts=32)
    options = {name: constants[name] for name in COMPILE_OPTIONS}
    assert "fma.rn.f32" in _ptx(tmp_path, options)
    unpinned = {name: value for name, value in options.items() if name != "enable_fp_fusion"}
    assert "fma.rn.f32" not in _ptx(tmp_path, unpinned)
