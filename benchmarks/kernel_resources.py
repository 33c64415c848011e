"""Compile the fused kernels for sm_90 on any machine (no GPU needed) and report what ptxas says.

Per kernel: registers per thread, spill stores and loads, shared memory per block, and every
ptxas performance warning. Two warnings matter most for a persistent kernel, because ptxas
applies them to the whole function, not to the loop that caused them:

* C7515, wgmma serialized because a non-wgmma instruction defines an accumulator register
  inside a pipeline stage. Every per-block weight-gradient reduction loop of the backward
  once caused it. The kernel's SwiGLU-backward, dx and weight-gradient tiles then all ran
  without overlapping wgmma. Replacing those loops with one flat strip loop removed it; on
  the H200 that was worth 14% on the SwiGLU-backward tiles and 10% on dx.
* C7512, wgmma serialized for lack of registers: 128 x 256 or 256 x 128 weight-gradient
  tiles and 128-column SwiGLU-backward tiles, next to everything else the kernel holds.

Shared memory above 227 KB per block (sm_90) fails at launch, not at compile time, so it is
checked here too. The kernels are compiled with the GPU's compile-time constants (bf16
operands, the GPU router precision) from the same launchers the layer uses; nothing runs.

    python benchmarks/kernel_resources.py                         # DeepSeek-V3 rank view
    python benchmarks/kernel_resources.py --case qwen3_full --backward-tiles dx_stages=3
    python benchmarks/kernel_resources.py --check                 # exit 1 on a finding
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

# The kernel modules must be compiled, not interpreted: import them before anything sets
# TRITON_INTERPRET. The launchers below refuse a CPU fabric unless the interpreter is on,
# so it is switched on afterwards, only to build them; no kernel is run.
os.environ["TRITON_INTERPRET"] = "0"
from kosmos_moe.kernels import expert_backward, expert_forward  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from kosmos_moe import ExpertLayer  # noqa: E402
from kosmos_moe.fabric import EmulatedWorld  # noqa: E402
from kosmos_moe.workspace import GPU_BACKWARD_TILES, GPU_TILES  # noqa: E402

# name: (preset, experts in the layer); the cases of layer_forward.py at one rank.
CASES = {
    "dsv3_rank": ("deepseek_v3", 32),
    "dsv3_full": ("deepseek_v3", 256),
    "qwen3_rank": ("qwen3_235b", 16),
    "qwen3_full": ("qwen3_235b", 128),
}
SM90_SHARED_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KB)
SERIALIZED = re.compile(r"\((C75\d\d)\).*wgmma.*serialized")


def tile_overrides(pairs: list[str], tiles):
    """``["dx_stages=3", ...]`` applied to a tiles dataclass (ints, or true/false)."""
    changes = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in {f.name for f in dataclasses.fields(tiles)}:
            raise SystemExit(f"unknown tile field {key!r} of {type(tiles).__name__}")
        changes[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return dataclasses.replace(tiles, **changes)


def kernel_calls(case: str, tiles, backward_tiles, tokens: int) -> dict:
    """The forward and backward launches of one rank of ``case``, as (kernel, args, constants)."""
    preset, experts = CASES[case]
    world = EmulatedWorld(1, "cpu")
    with torch.device("meta"):
        layer = getattr(ExpertLayer, preset)(
            num_experts=experts, dtype=torch.bfloat16, backend="kosmos", fabric=world.rank(0),
            max_tokens_per_rank=tokens,
            fused_options={"backward": True, "tiles": tiles, "backward_tiles": backward_tiles})
    layer.to_empty(device="cpu")  # uninitialised: only shapes, strides and dtypes matter
    fused = layer.fused()
    fused.prepare(torch.bfloat16)
    c = layer.config
    x = torch.empty(tokens, c.hidden_size, dtype=torch.bfloat16)
    top_e = torch.empty(tokens, c.top_k, dtype=torch.int32)
    top_w = torch.empty(tokens, c.top_k, dtype=torch.float32)
    d_router = torch.empty(layer.gate.weight.shape, dtype=torch.float32)
    gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
    return {
        "forward": fused.kernel_call(x, x, tokens, layer, on_gpu=True),
        "backward": fused.backward.kernel_call(x, x, x, top_e, top_w, tokens, layer.gate.weight, gu, dn,
                                               d_router, gu, dn, on_gpu=True),
    }


def ptxas_tool():
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90)
    except TypeError:  # older Triton: no architecture argument
        return get_ptxas()


def compile_sm90(kernel, args: tuple, constants: dict) -> dict:
    """Compile one launch for sm_90a and return ptxas' report on it."""
    constants = dict(constants)
    options = {"num_warps": constants.pop("num_warps")}
    if "STAGES" in constants:
        options["num_stages"] = constants["STAGES"]
    fn = kernel
    signature = {name: mangle_type(a) for name, a in zip(fn.arg_names, args)}
    signature.update({name: "constexpr" for name in constants})
    for p in fn.params[len(args):]:  # constexprs left at their defaults
        if p.name not in constants:
            signature[p.name] = "constexpr"
            constants[p.name] = p.default
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 64), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([ptxas_tool().path, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{text[-2000:]}")

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    warnings = [line.split("info    : ", 1)[-1] for line in text.splitlines() if re.search(r"\(C7\d\d\d\)", line)]
    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "shared_bytes": compiled.metadata.shared,
        "ptxas_warnings": warnings,
        "wgmma_serialized": sorted({m.group(1) for w in warnings if (m := SERIALIZED.search(w))}),
    }


def findings(report: dict) -> list[str]:
    out = []
    if report["wgmma_serialized"]:
        out.append(f"wgmma serialized ({', '.join(report['wgmma_serialized'])})")
    if report["shared_bytes"] > SM90_SHARED_LIMIT:
        out.append(f"{report['shared_bytes']} B of shared memory, over sm_90's {SM90_SHARED_LIMIT}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=list(CASES), default="dsv3_rank")
    parser.add_argument("--kernels", nargs="+", choices=["forward", "backward"], default=["forward", "backward"])
    parser.add_argument("--tiles", nargs="*", default=[], metavar="FIELD=VALUE", help="forward tile overrides")
    parser.add_argument("--backward-tiles", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="backward tile overrides")
    parser.add_argument("--tokens", type=int, default=4096, help="max tokens per rank (sizes the workspace)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a kernel serializes wgmma or overflows shared memory")
    parser.add_argument("--out", help="write the reports as JSON here")
    args = parser.parse_args()
    calls = kernel_calls(args.case, tile_overrides(args.tiles, GPU_TILES),
                         tile_overrides(args.backward_tiles, GPU_BACKWARD_TILES), args.tokens)
    reports, bad = {}, []
    for name in args.kernels:
        print(f"[{args.case}] compiling the {name} kernel for sm_90a", file=sys.stderr, flush=True)
        r = reports[name] = compile_sm90(*calls[name])
        found = findings(r)
        bad += [f"{name}: {f}" for f in found]
        print(f"{name:9} {r['registers']} registers, spills {r['spill_stores']} B stored / {r['spill_loads']} B loaded, "
              f"shared {r['shared_bytes']} B" + "".join(f"\n  ptxas: {w}" for w in r["ptxas_warnings"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"case": args.case, "ptxas": ptxas_tool().version, "kernels": reports}, f, indent=1)
    if args.check and bad:
        print("FAIL: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
