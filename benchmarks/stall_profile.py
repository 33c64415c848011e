"""Where the fused kernels' warps stall, per Python source line, from Nsight Compute.

The per-task busy times of ``layer_forward.py --profile`` say which task kind takes the time;
they cannot say why a GEMM loop runs below the dense rate. Nsight Compute's PC sampling can:
every few cycles it records, for one warp of each SM sub-partition, the instruction it is at
and why it is not issuing. Triton keeps line info in the cubin, so the samples map back to the
kernels' Python lines (``kernels/*.py``).

One command on a GPU machine with ``ncu`` on the PATH::

    python benchmarks/stall_profile.py --case dsv3_rank --out results/stalls

runs this script under ``ncu`` (``--target``: build the case's layer, call the fused forward
twice to compile and warm up, then once more to be profiled; ``--backward`` profiles the
backward launch of a training step instead; ``--variant`` builds the layer with one of
``layer_backward.py``'s or ``layer_forward.py``'s tile variants; ``--no-shared`` without
the case's shared expert) and writes, for CASE_DIRECTION (then _VARIANT, _noshared): the report
(``.ncu-rep``), its details page (``_details.txt``: speed of light, warp states, memory, and
the bytes moved to and from DRAM and L2's lookups by kind, also printed), its
source page per SASS instruction (``_sass.csv``) and per source line (``_lines.csv``), and
the lines with the most stall samples and their main stall reasons, then the innermost SASS
loops with theirs (``_lines.txt``, also printed). ``--aggregate FILE_lines.csv`` and ``--loops
FILE_sass.csv`` redo those tables without a GPU. The loops table exists because a line of an
inlined tile function sums all of its call sites: the dx and SwiGLU-backward tiles share one
GEMM loop line, but not one loop in the machine code.

Nsight Compute replays the kernel for its counters, restoring the memory it writes between
passes, so the self-scheduling kernel runs each pass from the same state. ``--clock-control
none`` leaves the clocks as they are. One case takes about a minute on an H200.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import shutil
import subprocess
import sys
import time

from layer_forward import CASES as LAYER_CASES, ONE_RANK_CASES, TOKENS, case_config
from layer_forward import TILE_VARIANTS as FORWARD_VARIANTS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KERNELS = {"forward": "expert_forward_kernel", "backward": "expert_backward_kernel"}
CASES = ONE_RANK_CASES


def log(msg: str) -> None:
    print(f"[stall_profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def variant_options(variant: str, backward: bool) -> dict:
    """``fused_options`` of a tile variant: layer_backward.py's for the backward, layer_forward.py's
    for the forward."""
    if variant == "default":
        return {}
    if backward:
        from layer_backward import VARIANTS
    else:
        VARIANTS = {name: {"tiles": tiles} for name, tiles in FORWARD_VARIANTS.items()}
    if variant not in VARIANTS:
        raise SystemExit(f"no {'backward' if backward else 'forward'} variant {variant!r}; "
                         f"choose from {', '.join(sorted(VARIANTS))}")
    return VARIANTS[variant]


def run_target(case: str, backward: bool, variant: str = "default", shared: bool = True) -> None:
    """The profiled program: one case's fused layer at one rank, called until warm, then once more."""
    import torch

    from kosmos_moe import ExpertLayer
    from kosmos_moe.fabric import EmulatedWorld

    EmulatedWorld.set_environment()
    preset, experts, _ = LAYER_CASES[case]
    torch.manual_seed(0)
    without = {} if shared else {"num_shared_experts": 0}
    layer = getattr(ExpertLayer, preset)(num_experts=experts, dtype=torch.bfloat16, device="cuda",
                                         backend="kosmos", max_tokens_per_rank=TOKENS,
                                         fused_options=variant_options(variant, backward), **without)
    if layer.gate.e_score_correction_bias is not None:
        layer.gate.e_score_correction_bias.data.uniform_(-0.05, 0.05)
    layer.requires_grad_(backward)
    x = torch.randn(TOKENS, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    for _ in range(3):  # the third call is the profiled one (ncu --launch-skip 2)
        if backward:
            layer(x).float().square().mean().backward()
        else:
            with torch.no_grad():
                layer(x)
        torch.cuda.synchronize()
        layer.fused().raise_if_failed()


def _number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:  # "-" where a metric does not apply
        return 0.0


def aggregate(lines_csv: str, top: int = 50) -> str:
    """Stall samples per kernel source line, from an ``ncu --page source --csv --print-source
    cuda,sass`` export.

    That export has a section per source file (a "File Path" row, then a header row); in it, a
    row with a line number carries that line's totals and the rows after it, with an address,
    its SASS instructions. Samples are counted per warp, so a line's share of the samples is
    its share of the kernel's warp time. A line of an inlined ``@triton.jit`` function counts
    for every caller (a tile GEMM's loop line holds all of its call sites).
    """
    with open(lines_csv, newline="") as f:
        rows = list(csv.reader(f))
    path, header = "?", None
    per_line: collections.Counter = collections.Counter()
    reasons: dict = collections.defaultdict(collections.Counter)
    source: dict = {}
    overall: collections.Counter = collections.Counter()
    for r in rows:
        if r and r[0] == "File Path":
            path = os.path.relpath(r[1], REPO) if r[1].startswith(REPO) else os.path.basename(r[1])
        elif r and r[0] == "Line No":
            header = r
        elif header is not None and len(r) == len(header) and r[0].strip():
            key = (path, int(r[0]))
            n = _number(r[header.index("Warp Stall Sampling (All Samples)")])
            per_line[key] += n
            source[key] = r[1].strip()
            for i, name in enumerate(header):
                if name.startswith("stall_") and "(Not Issued)" not in name:
                    reasons[key][name[6:]] += _number(r[i])
                    overall[name[6:]] += _number(r[i])
    total = sum(per_line.values())
    if not total:
        raise ValueError(f"{lines_csv}: no stall samples found")
    out = [f"{lines_csv}: {total:.0f} stall samples",
           "over the kernel: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in overall.most_common(10)), "",
           f"the {top} source lines with the most samples (share of all; then that line's main reasons):"]
    for key, n in per_line.most_common(top):
        why = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in reasons[key].most_common(3) if v)
        out.append(f"{100 * n / total:5.1f}%  {key[0]}:{key[1]:<5} {source[key][:70]:70} | {why}")
    return "\n".join(out)


# Instruction kinds counted per loop iteration: tensor-core products, asynchronous copies by
# thread (LDGSTS) and by the copy engine (UTMALDG), spill traffic, CTA barriers.
LOOP_OPS = ("HGMMA", "LDGSTS", "UTMALDG", "LDL", "STL", "BAR.SYNC")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-fA-F]+)")


def _opcode(sass: str) -> str:
    """``@!P1 BRA 0x10`` -> ``BRA``: the instruction without its predicate."""
    words = sass.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def loops(sass_csv: str, top: int = 8) -> str:
    """Stall samples per innermost SASS loop, from an ``ncu --page source --csv --print-source
    sass`` export.

    A loop is a backward branch and the instructions from its target to it; innermost loops
    (no other loop inside) are the GEMM and copy loops, whose per-line totals mix every call
    site of an inlined function. Per loop: its share of the samples and their main reasons,
    its instructions and how many of them are products, copies, spill loads or stores and
    barriers, how often its branch ran (warp instructions: iterations times warps), and the
    instructions holding the most samples.
    """
    with open(sass_csv, newline="") as f:
        rows = list(csv.reader(f))
    at = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if at is None:
        raise ValueError(f"{sass_csv}: no header row with Address and Source")
    header = rows[at]
    col = {name: header.index(name) for name in ("Address", "Source", "Warp Stall Sampling (All Samples)")}
    executed = header.index("Instructions Executed") if "Instructions Executed" in header else None
    reason_cols = [(i, name[6:]) for i, name in enumerate(header)
                   if name.startswith("stall_") and "(Not Issued)" not in name]
    body = [r for r in rows[at + 1:] if len(r) == len(header) and r[col["Address"]].startswith("0x")]
    address = [int(r[col["Address"]], 16) for r in body]
    samples = [_number(r[col["Warp Stall Sampling (All Samples)"]]) for r in body]
    total = sum(samples)
    if not total:
        raise ValueError(f"{sass_csv}: no stall samples found")
    index = {a: i for i, a in enumerate(address)}
    spans = []
    for i, r in enumerate(body):
        m = _BRANCH.search(r[col["Source"]])
        if m and int(m.group(1), 16) < address[i] and int(m.group(1), 16) in index:
            spans.append((index[int(m.group(1), 16)], i))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    ranked = sorted(inner, key=lambda span: -sum(samples[span[0]:span[1] + 1]))[:top]
    out = [f"{sass_csv}: {total:.0f} stall samples, {len(inner)} innermost loops; the {len(ranked)} with the most:"]
    for a, b in ranked:
        part = body[a:b + 1]
        n = sum(samples[a:b + 1])
        why = collections.Counter()
        for r in part:
            for i, name in reason_cols:
                why[name] += _number(r[i])
        opcodes = [_opcode(r[col["Source"]]) for r in part]
        ops = ", ".join(f"{op} {sum(code.startswith(op) for code in opcodes)}" for op in LOOP_OPS)
        runs = f", branch ran {_number(body[b][executed]):,.0f} times" if executed is not None else ""
        reasons = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in why.most_common(3) if v and n)
        out.append(f"{100 * n / total:5.1f}%  {body[a][col['Address']]}..{body[b][col['Address']]}: {b - a + 1} "
                   f"instructions ({ops}){runs}; {reasons}")
        for i in sorted(range(a, b + 1), key=lambda i: -samples[i])[:3]:
            if samples[i]:
                main = max(reason_cols, key=lambda rc: _number(body[i][rc[0]]))[1]
                out.append(f"         {100 * samples[i] / total:5.2f}%  {body[i][col['Source']].strip()[:60]:60} | {main}")
    return "\n".join(out)


# Bytes the kernel moved to and from DRAM, and L2's sector lookups by kind. Stop 48 (H100):
# DRAM moved about 2.5x what the DeepSeek-V3 32-expert forward must (weights once, tokens,
# intermediate and combine rows written and read once), and at Qwen3 128 experts L2 ran at 92%
# of its throughput; reads against writes say which data is fetched again.
TRAFFIC_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_read.sum",
                   "lts__t_sectors_op_write.sum", "lts__t_sectors_op_atom.sum", "lts__t_sectors_op_red.sum",
                   "lts__t_sector_op_read_hit_rate.pct")
# Sectors L2 took from the SMs and over the fabric between its two partitions: an SM's access to
# a line homed in the other partition crosses it, and how much of the reads beyond each buffer
# once (stops 49 and 50) is that is not yet known. Asked for apart, so that an ncu or GPU without
# these names still gives the ones above.
FABRIC_METRICS = ("lts__t_sectors_srcunit_tex.sum", "lts__t_sectors_srcunit_ltcfabric.sum")


def traffic(details: str) -> dict[str, float]:
    """``TRAFFIC_METRICS`` from ncu's details page printed in base units (``name  unit  value``
    rows), by name."""
    found = {}
    for line in details.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in TRAFFIC_METRICS + FABRIC_METRICS:
            found[parts[0]] = _number(parts[2])
    return found


def once_traffic(case: str, backward: bool, shared: bool = True) -> dict[str, float]:
    """Bytes the case's kernel reads and writes if each of its buffers is read once and written
    once (bf16 activations and weights, fp32 logits; one rank, every projection kept), the
    baseline for ``dram__bytes_read.sum`` and ``dram__bytes_write.sum``.

    Forward: reads the routed and shared weights, the router weight, the tokens, the
    intermediate rows (``T K I + T I_s``) and the combine rows (``T (K + shared) H``); writes
    the intermediate and combine rows and the output (profiled without grad: no logits kept).
    Backward: reads the tokens and output gradients (to copy them expert-major), the routed
    weights (dx and SwiGLU-backward tiles), the kept projections, the copied rows, ``[dg du]``,
    ``w h``, the combine rows and the logits; writes the copied rows, ``[dg du]``, ``w h``,
    the combine rows, the input gradient, the weight gradients and the logits' gradient."""
    c = case_config(case, **({} if shared else {"num_shared_experts": 0}))
    T, H, I, E, K = TOKENS, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.top_k
    I_s = c.shared_intermediate_size
    slots = K + (1 if I_s else 0)
    bf16, fp32 = 2, 4
    if not backward:
        weights = bf16 * (3 * E * H * I + 3 * H * I_s + E * H)
        inter, comb = bf16 * T * (K * I + I_s), bf16 * T * slots * H
        return {"read": weights + bf16 * T * H + inter + comb,
                "write": inter + comb + bf16 * T * H}
    copies = 2 * bf16 * T * K * H     # the tokens' and output gradients' rows, expert-major
    kept = dgu = 2 * bf16 * T * K * I  # the kept [g u] and the computed [dg du]
    hw = bf16 * T * K * I
    comb = bf16 * T * (K + 1) * H      # the routed rows and the router's part
    weights, logits = bf16 * 3 * E * H * I, fp32 * T * E
    read = 2 * bf16 * T * H + weights + kept + copies + dgu + hw + comb + logits + bf16 * E * H
    write = copies + dgu + hw + comb + bf16 * T * H + weights + logits
    return {"read": read, "write": write}


def profile(case: str, direction: str, out_dir: str, ncu: str, variant: str = "default",
            shared: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{case}_{direction}" + ("" if variant == "default" else f"_{variant}")
                        + ("" if shared else "_noshared"))
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{KERNELS[direction]}", "--launch-skip", "2",
           "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats",
           "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis",
           "--metrics", ",".join(TRAFFIC_METRICS + FABRIC_METRICS), "--import-source", "yes", "-f", "-o", stem,
           sys.executable, os.path.abspath(__file__), "--target", "--case", case, "--variant", variant]
    if direction == "backward":
        cmd.append("--backward")
    if not shared:
        cmd.append("--no-shared")
    log(" ".join(cmd))
    t0 = time.time()
    at = cmd.index("--metrics")
    if subprocess.run(cmd).returncode != 0:
        # A metric this ncu or GPU does not know fails the whole run: without the fabric's, then
        # without any.
        cmd[at + 1] = ",".join(TRAFFIC_METRICS)
        log("ncu failed with the L2 fabric metrics; again without them")
        if subprocess.run(cmd).returncode != 0:
            del cmd[at:at + 2]
            log("ncu failed with the traffic metrics; again without them")
            subprocess.run(cmd, check=True)
    log(f"profiled in {time.time() - t0:.0f} s")
    # Base units for traffic(); "--print-details all" adds each section's breakdown (which of
    # L2's units is the busy one), an option older ncu versions lack.
    page = [ncu, "--import", stem + ".ncu-rep", "--page", "details", "--print-units", "base"]
    shown = subprocess.run(page + ["--print-details", "all"], capture_output=True, text=True, check=False)
    if shown.returncode != 0:
        shown = subprocess.run(page, capture_output=True, text=True, check=False)
    details = shown.stdout
    with open(stem + "_details.txt", "w") as f:
        f.write(details)
    moved = traffic(details)
    if moved:
        log("traffic: " + ", ".join(f"{name} {value:,.0f}" for name, value in moved.items()))
        once = once_traffic(case, direction == "backward", shared)
        for kind in ("read", "write"):
            got = moved.get(f"dram__bytes_{kind}.sum")
            if got is not None:
                log(f"DRAM {kind} {got / 1e9:.2f} GB, {got / once[kind]:.2f}x the {once[kind] / 1e9:.2f} GB "
                    f"of every buffer {kind} once")
        fabric, from_sms = (moved.get(name) for name in FABRIC_METRICS[::-1])
        if fabric is not None and from_sms:
            log(f"L2 fabric {32 * fabric / 1e9:.2f} GB between the partitions, against {32 * from_sms / 1e9:.2f} GB "
                f"of the SMs' accesses ({fabric / from_sms:.0%})")
    # The source page per SASS instruction, and per source line with each line's instructions.
    for view, suffix in (("sass", "_sass.csv"), ("cuda,sass", "_lines.csv")):
        with open(stem + suffix, "w") as f:
            subprocess.run([ncu, "--import", stem + ".ncu-rep", "--page", "source", "--csv", "--print-source", view],
                           stdout=f, check=True)
    try:
        table = aggregate(stem + "_lines.csv")
    except Exception as exc:  # an export this script does not read: the raw files are kept
        table = f"could not aggregate {stem}_lines.csv: {exc!r}"
    try:
        table += "\n\n" + loops(stem + "_sass.csv")
    except Exception as exc:
        table += f"\n\ncould not find the loops of {stem}_sass.csv: {exc!r}"
    with open(stem + "_lines.txt", "w") as f:
        f.write(table + "\n")
    print(table)
    log(f"wrote {stem}_sass.csv, {stem}_lines.csv, {stem}_lines.txt, {stem}_details.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="dsv3_rank", choices=CASES)
    parser.add_argument("--backward", action="store_true", help="profile the backward launch of a training step")
    parser.add_argument("--variant", default="default",
                        help="a tile variant of layer_backward.py (with --backward) or layer_forward.py")
    parser.add_argument("--no-shared", dest="shared", action="store_false",
                        help="build the case without its shared expert (DeepSeek-V3's), to see what its tiles cost")
    parser.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/stalls")
    parser.add_argument("--aggregate", metavar="CSV", help="only print the per-line table of an export")
    parser.add_argument("--loops", metavar="CSV", help="only print the innermost SASS loops of a _sass.csv export")
    args = parser.parse_args()
    if args.aggregate:
        print(aggregate(args.aggregate))
    elif args.loops:
        print(loops(args.loops))
    elif args.target:
        run_target(args.case, args.backward, args.variant, args.shared)
    else:
        variant_options(args.variant, args.backward)  # an unknown variant fails here, before ncu starts
        ncu = shutil.which("ncu")
        if ncu is None:
            raise SystemExit("stall_profile.py needs Nsight Compute's ncu on the PATH")
        profile(args.case, "backward" if args.backward else "forward", args.out, ncu, args.variant, args.shared)


if __name__ == "__main__":
    main()
