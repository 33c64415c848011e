"""Compile the fused kernels for sm_90 on any machine (no GPU needed) and report what limits their GEMMs.

Per kernel: registers per thread, spill stores and loads, shared memory per block, bytes of
machine code, every ptxas performance warning, and each loop that issues wgmma, with whether
it keeps a wgmma in flight across iterations. The kernels are compiled from the same
launchers the layer uses, with the GPU's compile-time constants (bf16 operands, the GPU
router precision) and the launch's own specialization (16-byte aligned pointers are known
to be), and ptxas runs with the flags the installed Triton gives it (recorded from Triton's own
call, printed per kernel), so the code is what the GPU would build with this Triton; nothing
runs. What ``--check`` fails on:

* ptxas C7515: wgmma serialized because a non-wgmma instruction defines an accumulator
  register inside a pipeline stage. ptxas applies it to the whole function, and a persistent
  kernel is one function: every per-block weight-gradient reduction loop of the backward
  once caused it, and the kernel's SwiGLU-backward, dx and weight-gradient tiles all ran
  without overlapping wgmma. One flat strip loop per task removed it; on the H200 that was
  worth 14% on the SwiGLU-backward tiles and 10% on dx.
* ptxas C7512: wgmma serialized for lack of registers (256-column dx or SwiGLU-backward tiles
  beside weight-gradient strips reduced in one flat loop, 128 x 256 weight-gradient tiles
  beside 128 x 128 router-gradient tiles reduced 64 tokens a step, 128-column SwiGLU-backward
  tiles with three accumulators, next to everything else the kernel holds).
* A 16-bit wgmma loop that waits for every dot before going on. Triton keeps a wgmma in
  flight only if its shared-memory operands come from the pipeline's multi-buffered
  asynchronous copies; an operand read by a plain load (one the compiler cannot prove
  aligned enough to copy asynchronously) makes every dot of the loop synchronous. The
  forward's gate/up loop was such a loop: its rows are a select between rows in place and
  received rows, which lost their 16-byte alignment (``Tiles.row_alignment_hint``).
* Shared memory above 227 KB per block, which fails at launch, not at compile time.
* Fewer blocks per SM (registers, shared memory and warps, by the driver's rules) than the
  tiles' ``workers_per_sm``: the launcher would refuse the grid before its first launch.

    python benchmarks/kernel_resources.py                         # DeepSeek-V3 rank view
    python benchmarks/kernel_resources.py --case qwen3_full --backward-tiles dx_stages=3
    python benchmarks/kernel_resources.py --check                 # exit 1 on a finding
    python benchmarks/kernel_resources.py --kernels forward plain_gate_up --sass-loops
                        # each GEMM loop's machine code a step, in the fused kernel and alone
    python benchmarks/kernel_resources.py --case dsv3_full --ranks 2 --tokens 512   # an EP=2 rank
    python benchmarks/kernel_resources.py --kernels backward --spills 8   # where it spills
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

# `kosmos_moe` from the repository root without PYTHONPATH, as the other scripts get it from common.py.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The kernel modules must be compiled, not interpreted: import them before anything sets
# TRITON_INTERPRET. The launchers below refuse a CPU fabric unless the interpreter is on,
# so it is switched on afterwards, only to build them; no kernel is run.
os.environ["TRITON_INTERPRET"] = "0"
from kosmos_moe.kernels import expert_backward, expert_forward  # noqa: E402
import gemm_tiles  # noqa: E402  (its plain-grid kernels, compiled too)
from layer_forward import CASES as LAYER_CASES, ONE_RANK_CASES, case_config  # noqa: E402
from kosmos_moe.workspace import COMPILE_OPTIONS  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from kosmos_moe import ExpertLayer  # noqa: E402
from kosmos_moe.fabric import EmulatedWorld  # noqa: E402
from kosmos_moe.workspace import GPU_TILES, gpu_backward_tiles  # noqa: E402

CASES = ONE_RANK_CASES  # layer_forward.py's cases of one rank
SM90_SHARED_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KB)
SM90_SHARED_PER_SM = 233472  # 228 KB per SM, of which the driver reserves 1 KB per block
SM90_REGISTERS_PER_SM = 65536
SM90_WARPS_PER_SM = 64
SERIALIZED = re.compile(r"\((C75\d\d)\).*wgmma.*serialized")


def sm90_blocks_per_sm(registers: int, shared: int, warps: int) -> int:
    """Blocks resident per sm_90 SM at once (the driver's occupancy rules: registers are
    allocated per warp in units of 256, shared memory per block plus 1 KB reserved)."""
    warp_registers = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS_PER_SM // warp_registers // warps
    by_shared = SM90_SHARED_PER_SM // (shared + 1024)
    return min(by_registers, by_shared, SM90_WARPS_PER_SM // warps, 32)


def tile_overrides(pairs: list[str], tiles):
    """``["dx_stages=3", ...]`` applied to a tiles dataclass (ints, or true/false)."""
    changes = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in {f.name for f in dataclasses.fields(tiles)}:
            raise SystemExit(f"unknown tile field {key!r} of {type(tiles).__name__}")
        changes[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return dataclasses.replace(tiles, **changes)


def kernel_calls(case: str, tiles, backward_tiles, tokens: int, ranks: int = 1) -> dict:
    """The forward and backward launches of rank 0 of ``case`` in a world of ``ranks``, as
    (kernel, args, constants). With several ranks the backward is the one that keeps only
    some rows' gate/up projections and redoes the others'."""
    preset, experts, _ = LAYER_CASES[case]
    world = EmulatedWorld(1, "cpu")
    if ranks > 1:
        # Nothing runs, so rank 0 of a CPU world of several ranks is enough to build its
        # kernels (EmulatedWorld refuses such a world for running: the interpreter runs
        # programs one after another). Every rank's workspace is allocated: keep --tokens small.
        world.world_size, world._requests = ranks, [0] * ranks
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
    saved = fused._saved_gate_up(tokens, torch.bfloat16, layer.shared_experts is not None)
    return {
        "forward": fused.kernel_call(x, x, tokens, layer, on_gpu=True, saved=saved),
        "backward": fused.backward.kernel_call(x, x, x, top_e, top_w, tokens, saved, layer.gate.weight, gu, dn,
                                               d_router, gu, dn, on_gpu=True),
    }


def ptxas_tool():
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90)
    except TypeError:  # older Triton: no architecture argument
        return get_ptxas()


def code_bytes(cubin: str, kernel_name: str) -> int:
    """Bytes of machine code of ``kernel_name`` in ``cubin`` (its ELF ``.text`` section; 16 per
    sm_90 instruction). Every task of a persistent kernel is in one function, so each code path
    added to it, run or not, adds to what the instruction caches hold."""
    with open(cubin, "rb") as f:
        elf = f.read()
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, = struct.unpack_from("<I", elf, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", elf, shoff + i * shentsize + 0x18)
        return name, offset, size

    _, names, _ = section(shstrndx)
    for i in range(shnum):
        name, _, size = section(i)
        end = elf.index(b"\0", names + name)
        if elf[names + name:end].decode() == f".text.{kernel_name}":
            return size
    raise ValueError(f"no .text.{kernel_name} in {cubin}")


_SASS_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def line_sass(cubin: str) -> str:
    """The SASS of ``cubin`` with each instruction's innermost source line (``//## File`` lines,
    from the line information Triton has ptxas keep), inlined helpers included."""
    nvdisasm = os.path.join(os.path.dirname(ptxas_tool().path), "nvdisasm")
    if not os.path.exists(nvdisasm):
        raise RuntimeError(f"--spills and --sass-loops need nvdisasm beside {ptxas_tool().path}")
    return subprocess.run([nvdisasm, "-g", "-c", cubin], check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def ptxas_flags_of_triton(tmp: str):
    """Within the block, Triton's ptxas calls go through a wrapper that records their arguments,
    and every compile runs ptxas (no cache); yields the list, filled with the last compile's
    arguments once the block's compile has run. Triton's flags differ by release (3.8 and 3.9
    add ``--regAllocOptLevel=2``), and ptxas run without them can make other code than the GPU
    runs."""
    real = ptxas_tool().path
    wrapper, recorded = os.path.join(tmp, "ptxas"), os.path.join(tmp, "ptxas.args")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\ncase "$1" in --version) ;; *) printf "%s\\n" "$@" > "{recorded}" ;; esac\n'
                f'exec "{real}" "$@"\n')
    os.chmod(wrapper, 0o755)
    flags: list[str] = []
    with mock.patch.dict(os.environ, TRITON_PTXAS_PATH=wrapper, TRITON_PTXAS_BLACKWELL_PATH=wrapper,
                         TRITON_ALWAYS_COMPILE="1"):
        yield flags
    with open(recorded) as f:
        argv = f.read().splitlines()
    # Triton's call ends "SOURCE.ptx -o OUTPUT"; keep what comes before.
    flags.extend(a for a in argv[:argv.index("-o") - 1] if a != "-suppress-debug-info")
    if "-lineinfo" not in flags:
        flags.append("-lineinfo")


def spill_sites(sass: str, top: int) -> list[dict]:
    """The ``top`` source lines with the most spill instructions (``STL``/``LDL``) in ``sass``."""
    sites: dict[str, dict] = {}
    line = "?"
    for text in sass.splitlines():
        m = _SASS_LINE.search(text)
        if m:
            line = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif re.search(r"\bSTL(\.|\s)", text) or re.search(r"\bLDL(\.|\s)", text):
            site = sites.setdefault(line, {"line": line, "stores": 0, "loads": 0})
            site["stores" if "STL" in text else "loads"] += 1
    return sorted(sites.values(), key=lambda s: -(s["stores"] + s["loads"]))[:top]


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_SASS_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
# What a GEMM step is made of: tensor-core products, asynchronous copies by thread (LDGSTS) and
# by the copy engine (UTMALDG), their waits (DEPBAR; SYNCS: mbarrier operations), CTA barriers,
# plain global loads and stores, and spills.
SASS_OPS = ("HGMMA", "LDGSTS", "UTMALDG", "DEPBAR", "SYNCS", "BAR", "LDG", "STG", "LDL", "STL")


def sass_loops(sass: str) -> list[dict]:
    """Each innermost loop of ``sass`` that issues wgmma (``HGMMA``): its source line (the line
    with the most of its instructions), its instructions per iteration and how many of each of
    :data:`SASS_OPS`, so that one loop's code can be compared with another's (the fused kernel's
    routed gate/up loop with gemm_tiles.py's, say) without a GPU."""
    instructions, labels, line = [], {}, "?"
    for text in sass.splitlines():
        if m := _SASS_LABEL.match(text):
            labels[m.group(1)] = len(instructions)
        elif m := _SASS_LINE.search(text):
            line = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif m := _SASS_INSTRUCTION.match(text):
            instructions.append((m.group(1), line))
    spans = []
    for end, (text, _) in enumerate(instructions):
        m = _SASS_BRANCH.search(text)
        if m and m.group(1) in labels and labels[m.group(1)] <= end:
            spans.append((labels[m.group(1)], end))
    loops = []
    for start, end in spans:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in spans):
            continue  # not innermost
        body = instructions[start:end + 1]
        ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text, _ in body]
        if "HGMMA" not in ops:
            continue
        lines: dict[str, int] = {}
        for _, at in body:
            lines[at] = lines.get(at, 0) + 1
        loops.append({"source": max(lines, key=lines.get), "instructions": len(body),
                      **{op: ops.count(op) for op in SASS_OPS}})
    return loops


def plain_gate_up_call(case: str, tiles, tokens: int) -> tuple:
    """gemm_tiles.py's plain grid of one-dot gate/up tiles, rows gathered by pointers and weights
    by TMA, at ``case``'s shape and the forward's tiles, as (kernel, args, constants): the same
    tile function as the fused kernel's routed gate/up tiles, alone in a grid of its own (stop
    44: 729 TFLOP/s there, about 630 in the fused kernel, DeepSeek-V3 32 experts, H100)."""
    config = case_config(case)
    H, I, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    rows = tokens * config.top_k
    x = torch.empty(tokens, H, dtype=torch.bfloat16)
    gathered = torch.empty(rows, H, dtype=torch.bfloat16)
    index = torch.empty(rows, dtype=torch.int32)
    n_tiles = rows // tiles.rows + E
    per_tile = torch.empty(n_tiles, dtype=torch.int32)
    w = torch.empty(2 * E, I, H, dtype=torch.bfloat16)
    h = torch.empty(rows, I, dtype=torch.bfloat16)
    args = (x, gemm_tiles.TensorDescriptor.from_tensor(gathered, [tiles.rows, tiles.depth]), index, per_tile,
            per_tile, per_tile, n_tiles, gemm_tiles.TensorDescriptor.from_tensor(w, [2, tiles.gate_up_cols, tiles.depth]),
            h)
    constants = dict(H=H, I=I, BM=tiles.rows, BN=tiles.gate_up_cols, BK=tiles.depth, STAGES=tiles.stages, GATHER=True,
                     DOT_DTYPE=gemm_tiles.tl.bfloat16, ONE_DOT=True, num_warps=tiles.warps)
    return gemm_tiles._gate_up_grid_tma, args, constants


def compile_sm90(kernel, args: tuple, constants: dict, dump: str | None = None, spill_lines: int = 0,
                 loops: bool = False) -> dict:
    """Compile one launch for sm_90a and return ptxas' report on it (TTGIR and PTX into ``dump``;
    with ``spill_lines``, that many source lines with the most spill instructions; with
    ``loops``, the SASS of each innermost wgmma loop, :func:`sass_loops`)."""
    constants = dict(constants)
    options = {k: constants.pop(k) for k in COMPILE_OPTIONS if k in constants}  # as launched
    signature = {name: mangle_type(a) for name, a in zip(kernel.arg_names, args)}
    signature.update({name: "constexpr" for name in constants})
    for p in kernel.params[len(args):]:  # constexprs left at their defaults
        if p.name not in constants:
            signature[p.name] = "constexpr"
            constants[p.name] = p.default
    # What the launch specializes on (triton.backends.compiler.BaseBackend): 16-byte aligned
    # pointers and multiples of 16 are known divisible by 16, which decides whether loads are
    # vectorized and pipelined through asynchronous copies.
    attrs = {}
    for i, (p, a) in enumerate(zip(kernel.params, args)):
        aligned = (isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0) or (
            isinstance(a, int) and not isinstance(a, bool) and not p.do_not_specialize and a % 16 == 0)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    with tempfile.TemporaryDirectory() as tmp:
        with ptxas_flags_of_triton(tmp) as flags:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 64), options=options)
        if dump:
            os.makedirs(dump, exist_ok=True)
            for kind in ("ttgir", "ptx"):
                with open(os.path.join(dump, f"{kernel.__name__}.{kind}"), "w") as f:
                    f.write(compiled.asm[kind])
        # ptxas again, with Triton's own flags, for its report (-v), which Triton does not keep.
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([ptxas_tool().path, *flags, ptx, "-o", cubin], capture_output=True, text=True)
        text = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed:\n{text[-2000:]}")
        code = code_bytes(cubin, compiled.metadata.name)
        sass = line_sass(cubin) if spill_lines or loops else ""
        sites = spill_sites(sass, spill_lines) if spill_lines else []
        machine_loops = sass_loops(sass) if loops else []

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    warnings = [line.split("info    : ", 1)[-1] for line in text.splitlines() if re.search(r"\(C7\d\d\d\)", line)]
    registers = number(r"Used (\d+) registers")
    return {
        "registers": registers,
        "ptxas_flags": flags,
        "warps": compiled.metadata.num_warps,
        "blocks_per_sm": sm90_blocks_per_sm(registers, compiled.metadata.shared, compiled.metadata.num_warps),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "shared_bytes": compiled.metadata.shared,
        "code_bytes": code,
        "ptxas_warnings": warnings,
        "wgmma_serialized": sorted({m.group(1) for w in warnings if (m := SERIALIZED.search(w))}),
        "wgmma_loops": wgmma_loops(compiled.asm["ttgir"]),
        "spill_sites": sites,
        "sass_loops": machine_loops,
    }


_LOC_DEF = re.compile(r'^#(loc\d*) = loc\((.*)\)$')


def _source(loc: str, defs: dict, depth: int = 0) -> list[str]:
    """``file:line`` frames of a TTGIR location, innermost first."""
    body = defs.get(loc, "")
    if depth > 50 or not body:
        return []
    m = re.match(r'"([^"]+)":(\d+):\d+', body)
    if m:
        return [f"{os.path.basename(m.group(1))}:{m.group(2)}"]
    m = re.match(r"callsite\(#(loc\d*) at #(loc\d*)\)", body)
    if m:
        return _source(m.group(1), defs, depth + 1) + _source(m.group(2), defs, depth + 1)
    m = re.match(r'"[^"]*"\(#(loc\d*)\)', body)  # a named location
    return _source(m.group(1), defs, depth + 1) if m else []


def wgmma_loops(ttgir: str) -> list[dict]:
    """Every loop whose body issues wgmma (innermost loops), and whether it keeps one in flight.

    ``in_flight`` is false when every ``warp_group_dot_wait`` in the loop waits for zero
    pending dots: each wgmma then finishes before the loop moves on, as when an operand is a
    plain load instead of a pipelined asynchronous copy (Triton's WGMMA pipelining rules).
    """
    lines = ttgir.splitlines()
    defs = {m.group(1): m.group(2) for line in lines if (m := _LOC_DEF.match(line))}
    loops, open_loops = [], []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if open_loops and line.lstrip().startswith("}") and indent == open_loops[-1]["indent"]:
            loop = open_loops.pop()
            m = re.search(r"tt.num_stages = (\d+)", line)
            loop["stages"] = int(m.group(1)) if m else None
            if loop["dots"]:
                loops.append(loop)
            continue
        if re.search(r"\bscf\.for\b", line):
            open_loops.append({"indent": indent, "dots": 0, "dtype": None, "pendings": [], "plain_loads": 0,
                               "async_loads": 0, "source": ""})
            continue
        if not open_loops:
            continue
        loop = open_loops[-1]
        if "ttng.warp_group_dot " in line:
            loop["dots"] += 1
            m = re.search(r": (?:!ttg\.memdesc|tensor)<[\dx]+x(\w+?)[,>]", line)
            loop["dtype"] = m.group(1) if m else loop["dtype"]
            m = re.search(r"loc\(#(loc\d*)\)\s*$", line)
            if m and not loop["source"]:
                frames = _source(m.group(1), defs)
                loop["source"] = frames[0] + (f" ({frames[-1]})" if len(frames) > 1 else "") if frames else ""
        m = re.search(r"warp_group_dot_wait .*pendings = (\d+)", line)
        if m:
            loop["pendings"].append(int(m.group(1)))
        if re.search(r"= tt\.load .*: tensor<\d+x\d+x!tt\.ptr", line):
            loop["plain_loads"] += 1
        if re.search(r"async_copy_global_to_local|async_tma_copy|tt\.descriptor_load", line):
            loop["async_loads"] += 1
    for loop in loops:
        del loop["indent"]
        loop["in_flight"] = any(p > 0 for p in loop["pendings"])
    return loops


def findings(report: dict, workers_per_sm: int = 1) -> list[str]:
    out = []
    if report["blocks_per_sm"] < workers_per_sm:
        out.append(f"{workers_per_sm} workers per SM asked, {report['blocks_per_sm']} fit (the launcher refuses it)")
    if report["wgmma_serialized"]:
        out.append(f"wgmma serialized ({', '.join(report['wgmma_serialized'])})")
    for loop in report["wgmma_loops"]:
        # 16-bit operands are the expert GEMMs; the fp32 router products run one stage.
        if loop["dtype"] in ("bf16", "f16") and not loop["in_flight"]:
            out.append(f"wgmma loop at {loop['source']} waits for every dot ({loop['plain_loads']} operand "
                       "loads not asynchronous)")
    if report["shared_bytes"] > SM90_SHARED_LIMIT:
        out.append(f"{report['shared_bytes']} B of shared memory, over sm_90's {SM90_SHARED_LIMIT}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, default="dsv3_rank")
    parser.add_argument("--kernels", nargs="+", choices=["forward", "backward", "plain_gate_up"],
                        default=["forward", "backward"],
                        help="plain_gate_up: gemm_tiles.py's gate/up grid, the forward's routed gate/up tile alone")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="FIELD=VALUE", help="forward tile overrides")
    parser.add_argument("--backward-tiles", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="backward tile overrides, on the case's default (kosmos_moe.workspace.gpu_backward_tiles)")
    parser.add_argument("--tokens", type=int, default=4096, help="max tokens per rank (sizes the workspace)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="expert-parallel world size (the case's experts are split among the ranks)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on serialized wgmma, a 16-bit wgmma loop without a dot in flight, "
                             "shared memory over 227 KB, or fewer blocks per SM than workers_per_sm")
    parser.add_argument("--out", help="write the reports as JSON here")
    parser.add_argument("--dump", help="write each kernel's TTGIR and PTX into this directory")
    parser.add_argument("--spills", type=int, default=0, metavar="N",
                        help="also list the N source lines with the most spill instructions")
    parser.add_argument("--sass-loops", action="store_true",
                        help="also list each innermost wgmma loop's machine code: instructions per "
                             "iteration, products, copies, waits and barriers")
    args = parser.parse_args()
    local_experts = LAYER_CASES[args.case][1] // args.ranks
    tiles = {"forward": tile_overrides(args.tiles, GPU_TILES),
             "backward": tile_overrides(args.backward_tiles, gpu_backward_tiles(local_experts, args.ranks == 1))}
    calls = kernel_calls(args.case, tiles["forward"], tiles["backward"], args.tokens, args.ranks)
    if "plain_gate_up" in args.kernels:
        calls["plain_gate_up"] = plain_gate_up_call(args.case, tiles["forward"], args.tokens)
        tiles["plain_gate_up"] = tiles["forward"]
    reports, bad = {}, []
    for name in args.kernels:
        print(f"[{args.case}] compiling the {name} kernel for sm_90a", file=sys.stderr, flush=True)
        r = reports[name] = compile_sm90(*calls[name], dump=args.dump, spill_lines=args.spills, loops=args.sass_loops)
        found = findings(r, tiles[name].workers_per_sm)
        bad += [f"{name}: {f}" for f in found]
        print(f"{name:9} {r['registers']} registers, spills {r['spill_stores']} B stored / "
              f"{r['spill_loads']} B loaded, shared {r['shared_bytes']} B, code {r['code_bytes']} B, "
              f"{r['warps']} warps: {r['blocks_per_sm']} per SM"
              f"\n  ptxas {' '.join(r['ptxas_flags'])}"
              + "".join(f"\n  ptxas: {w}" for w in r["ptxas_warnings"]))
        for loop in r["wgmma_loops"]:
            print(f"  wgmma loop {loop['source']}: {loop['dots']} {loop['dtype']} dots, "
                  f"{'one in flight' if loop['in_flight'] else 'each waited for'}, operand loads "
                  f"{loop['async_loads']} async / {loop['plain_loads']} plain, {loop['stages']} stages")
        for loop in r["sass_loops"]:
            print(f"  sass loop {loop['source']}: {loop['instructions']} instructions an iteration; "
                  + ", ".join(f"{op} {loop[op]}" for op in SASS_OPS if loop[op]))
        if r["spill_sites"]:
            print("  spills at " + ", ".join(f"{site['line']} ({site['stores']} st, {site['loads']} ld)"
                                             for site in r["spill_sites"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"case": args.case, "ptxas": ptxas_tool().version, "kernels": reports}, f, indent=1)
    if args.check and bad:
        print("FAIL: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
