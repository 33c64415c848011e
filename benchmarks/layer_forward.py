"""Forward of the whole expert layer on one GPU: the fused kernel against the reference backend.

The reference backend is the path most users run today (argsort permute, SwiGLU through
``torch._grouped_mm``, weighted fold), so it is the baseline. In the same run the script
measures both ceilings of the roofline, a dense bf16 matmul rate and the device copy
bandwidth, and ``torch._grouped_mm`` alone on the same rows.

    python benchmarks/layer_forward.py --out results.json            # all cases
    python benchmarks/layer_forward.py --cases dsv3_rank --tiles     # with tile variants

Figures per case: time of each backend, their ratio, the fused kernel's fraction of the
roofline ``max(FLOPs / dense rate, expert-weight bytes / copy bandwidth)``, and the expert-GEMM
rate inside the kernel (GEMM FLOPs over the mean per-worker time spent in GEMM tasks, from a
profiled run), next to ``torch._grouped_mm``'s on the same rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import torch
from torch import nn

from common import AGREEMENT, disagreement, disagrees, environment, require_cuda

from kosmos_moe import ExpertLayer
from kosmos_moe.config import DEEPSEEK_V3, QWEN3_235B, MoEConfig
from kosmos_moe.fabric import EmulatedWorld
from kosmos_moe.workspace import GPU_TILES

TOKENS = 4096

CASES = {
    # name: (preset, experts in the layer, emulated ranks)
    "dsv3_rank": ("deepseek_v3", 32, 1),      # one EP8 rank's share of DeepSeek-V3
    "dsv3_full": ("deepseek_v3", 256, 1),     # all experts at EP=1: bound by weight bandwidth
    "qwen3_rank": ("qwen3_235b", 16, 1),
    "qwen3_full": ("qwen3_235b", 128, 1),
    "dsv3_emulated8": ("deepseek_v3", 256, 8),  # 8 virtual ranks x 4096 tokens vs EP=1 on 32768
}

# The cases of one rank (an emulated world's ranks would be serialised under a profiler).
ONE_RANK_CASES = tuple(name for name, (_, _, ranks) in CASES.items() if ranks == 1)


def case_config(name: str, **overrides) -> MoEConfig:
    """The layer shape of case ``name`` (its preset with the case's expert count)."""
    preset, experts, _ = CASES[name]
    preset_config = {"deepseek_v3": DEEPSEEK_V3, "qwen3_235b": QWEN3_235B}[preset]
    return dataclasses.replace(preset_config, num_experts=experts, **overrides)


TILE_VARIANTS = {
    "default": GPU_TILES,
    "pointer_weights": dataclasses.replace(GPU_TILES, tma=False),
    "down128": dataclasses.replace(GPU_TILES, down_cols=128),
    # Four stages for the gate/up tiles too, so every expert tile has 4 (196,640 B of shared
    # memory offline): more weight bytes in flight per worker where the weights' bandwidth
    # bounds the layer (256 experts). Tiles.stages has the figures.
    "stages4": dataclasses.replace(GPU_TILES, stages=4),
    # Three gate/up stages at every expert count (the default until stop 51, which pipelines 4
    # from 128 local experts, Tiles.many_experts_stages).
    "stages3": dataclasses.replace(GPU_TILES, many_experts_stages=3),
    # A held dispatch chunk run at the holder's next idle pass, as before stop 46
    # (Tiles.held_chunk_first), at the default's 3 gate/up stages and at 4.
    "held_chunk_later": dataclasses.replace(GPU_TILES, held_chunk_first=False),
    "stages4_held_chunk_later": dataclasses.replace(GPU_TILES, stages=4, held_chunk_first=False),
    # Each routed tile's expert entries in one reduction over the local experts at any expert
    # count (Tiles.merged_lookup_from; the default from 256), and never.
    "merged_lookup": dataclasses.replace(GPU_TILES, merged_lookup_from=1),
    "separate_lookup": dataclasses.replace(GPU_TILES, merged_lookup_from=1 << 30),
    # Routed gate/up tiles claim their next ticket as the previous one starts (the default until
    # stop 51, Tiles.gate_up_claim_ahead): tiles that share a weight block start further apart.
    "gate_up_claim_ahead": dataclasses.replace(GPU_TILES, gate_up_claim_ahead=True),
    "rows64": dataclasses.replace(GPU_TILES, rows=64, gate_up_cols=128, down_cols=256),
    "no_row_hint": dataclasses.replace(GPU_TILES, row_alignment_hint=False),
    # The route tiles before d522b32 (64 tokens, 32 experts a step). H100 80GB, stop 36, one run:
    # 11.61 against 11.57 ms at DeepSeek-V3 256 experts, 3.76 against 3.40 at Qwen3 128.
    "route64_depth32": dataclasses.replace(GPU_TILES, route_tokens=64, route_depth=32),
    # The router GEMM with one copy in flight (the default until stop 38).
    "route_stages2": dataclasses.replace(GPU_TILES, route_stages=2),
    # Route steps 128 deep (half the steps; 221,184 B of shared memory at 256 experts offline,
    # 147,480 B below 128). Untimed (stop 38).
    "route_depth128": dataclasses.replace(GPU_TILES, route_depth=128),
    "gate_up_two_dots": dataclasses.replace(GPU_TILES, gate_up_one_dot=False),
    # Weight descriptors with Triton's own 128-byte L2 promotion, the default until stop 45
    # (Tiles.weight_l2_promotion, 256 since, has the figures).
    "weights_l2_128": dataclasses.replace(GPU_TILES, weight_l2_promotion=128),
    # The down tiles' 3 stages, the default until stop 41 (Tiles.down_stages has the figures).
    "down_stages3": dataclasses.replace(GPU_TILES, down_stages=3),
    # Two workers of one warpgroup per SM (Tiles.workers_per_sm), each tile a warpgroup's:
    # 128 x 128 tiles (gate/up as one dot of 64 + 64 columns) in 3 stages (98 KB of shared
    # memory offline, so two fit), or 64 x 256 tiles in 2 stages (82 KB).
    "two_per_sm": dataclasses.replace(GPU_TILES, warps=4, workers_per_sm=2, gate_up_cols=64, down_cols=128, stages=3,
                                      down_stages=3),
    "two_per_sm_rows64": dataclasses.replace(GPU_TILES, warps=4, workers_per_sm=2, rows=64, stages=2,
                                             down_stages=2),
    # 256-row tiles, half as wide (the same accumulator): where an expert has about 256 rows
    # (Qwen3 128 experts), fewer tiles reading each weight block. Slower everywhere: H100 80GB,
    # stop 40, one run, forward device ms default / rows256: Qwen3 128 experts 3.12 / 3.65 (the
    # rows of half the experts spill past 256, so 4416 gate/up tiles of equal work against
    # 3744), DeepSeek-V3 32 experts 5.54 / 6.19, Qwen3 16 experts 2.14 / 2.65 (gate/up tiles of
    # equal work 65.3 against 50.1 us).
    "rows256": dataclasses.replace(GPU_TILES, rows=256, gate_up_cols=64, down_cols=128),
}


# Cases and variants whose results disagreed with the reference: the run goes on to time the
# rest, then exits with status 1 naming them.
WRONG: list[str] = []


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# About 25 ms of GPU time at the H200's clock: longer than the host takes to issue a layer's
# forward and backward.
QUEUE_AHEAD_CYCLES = 50_000_000


def timed(fn, warmup: int = 2, iters: int = 8, queued: bool = True) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, timed with CUDA events.

    ``queued``: the stream is kept busy while the host issues ``fn``'s work, so the figure is
    the device's time for that work, as when the host runs ahead (training loops, CUDA
    graphs). Otherwise each call starts on an idle stream and the figure also holds the
    host's time up to its first launch, which varied by a few tenths of a millisecond between
    processes on the H200 host (the same kernel's per-worker busy time did not).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_mm = timed(lambda: a @ b, iters=10)
    src = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), iters=10)
    return {
        "dense_tflops": 2 * n**3 / t_mm / 1e12,
        # Bytes read plus bytes written per second: the rate at which weights can stream.
        "copy_gbps": 2 * src.numel() * src.element_size() / t_copy / 1e9,
    }


def work(config, tokens: int, experts_touched: int) -> dict[str, float]:
    H, I, I_s, K, E = (config.hidden_size, config.moe_intermediate_size, config.shared_intermediate_size,
                       config.top_k, config.num_experts)
    gemm = 6 * tokens * K * H * I + 6 * tokens * H * I_s
    router = 2 * tokens * H * E
    weight_bytes = 2 * (3 * experts_touched * H * I + 3 * H * I_s + E * H)
    return {"gemm_flops": gemm, "flops": gemm + router, "weight_bytes": weight_bytes}


def task_times(reports: list[dict], kinds: tuple[str, ...]) -> dict:
    """Per task kind, over the ranks' profile reports: tasks run, mean microseconds per task and,
    where the kernel times it (a ``KIND_epilogue`` slot), the part after the task's last dot."""
    times = {}
    for kind in kinds:
        tasks = sum(rep[kind]["passes"] for rep in reports)
        seconds = sum(rep[kind]["seconds"] for rep in reports)
        times[kind] = {"tasks": tasks, "us_per_task": 1e6 * seconds / max(tasks, 1)}
        if f"{kind}_epilogue" in reports[0]:
            epilogue = sum(rep[f"{kind}_epilogue"]["seconds"] for rep in reports)
            times[kind]["epilogue_us_per_task"] = 1e6 * epilogue / max(tasks, 1)
    return times


def describe_task_times(times: dict) -> str:
    """``task_times`` as one log line."""
    return ", ".join(f"{k} {t['tasks']} x {t['us_per_task']:.1f} us"
                     + (f" (after the last dot {t['epilogue_us_per_task']:.1f})" if "epilogue_us_per_task" in t else "")
                     for k, t in times.items())


def launch_ends(launchers: list) -> dict:
    """How unevenly the workers of the last profiled call started and left, per rank then the
    worst rank: microseconds from the first start to the last exit, the spread of the starts
    and of the exits, and the mean worker's wait for the last one out (the launch's end that
    ran on fewer than all workers, as a share of the launch)."""
    ranks = []
    for launcher in launchers:
        spans = launcher.worker_spans_us()
        start, leave = spans[:, 0], spans[:, 1]
        launch = float(leave.max())
        tail = float((leave.max() - leave).mean())
        ranks.append({"launch_us": launch, "start_spread_us": float(start.max()),
                      "exit_spread_us": float(leave.max() - leave.min()), "mean_tail_us": tail,
                      "mean_tail_share": tail / launch})
    return max(ranks, key=lambda r: r["mean_tail_share"])


def describe_launch_ends(ends: dict) -> str:
    """``launch_ends`` as one log line."""
    return (f"launch {ends['launch_us']:.1f} us, workers started within {ends['start_spread_us']:.1f} us "
            f"and left within {ends['exit_spread_us']:.1f} us; the mean worker waited "
            f"{ends['mean_tail_us']:.1f} us for the last ({100 * ends['mean_tail_share']:.1f}% of the launch)")


def grouped_mm_alone(layer: ExpertLayer, x: torch.Tensor) -> float:
    """Seconds of the two ``torch._grouped_mm`` calls of the reference path on the same rows."""
    import torch.nn.functional as F

    with torch.no_grad():
        routing = layer.gate(x)
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // layer.config.top_k)
        offs = torch.cumsum(torch.bincount(flat, minlength=layer.config.num_experts), 0, dtype=torch.int32)
        wgu = layer.experts.gate_up_proj.transpose(-2, -1)
        wd = layer.experts.down_proj.transpose(-2, -1)
        h = F.silu(torch._grouped_mm(rows, wgu, offs=offs)[:, : layer.config.moe_intermediate_size])
        return timed(lambda: (torch._grouped_mm(rows, wgu, offs=offs), torch._grouped_mm(h, wd, offs=offs)))


def rank_layers(full: ExpertLayer, world: EmulatedWorld, max_tokens: int, tiles, profile: bool) -> list[ExpertLayer]:
    """The emulated ranks' layers, sharing the full layer's weights (expert slices are views)."""
    shape = dataclasses.asdict(full.config)
    positional = [shape.pop(k) for k in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k")]
    layers = []
    for r in range(world.world_size):
        with torch.device("meta"):
            layer = ExpertLayer(*positional, **shape, backend="kosmos", fabric=world.rank(r),
                                max_tokens_per_rank=max_tokens, dtype=torch.bfloat16,
                                fused_options={"tiles": tiles, "profile": profile})
        first, last = layer.local_expert_range
        layer.gate = full.gate
        layer.shared_experts = full.shared_experts
        layer.experts.gate_up_proj = nn.Parameter(full.experts.gate_up_proj[first:last], requires_grad=False)
        layer.experts.down_proj = nn.Parameter(full.experts.down_proj[first:last], requires_grad=False)
        layer.tokens_per_expert = torch.zeros_like(full.tokens_per_expert)
        layer.load_since_bias_update = torch.zeros_like(full.load_since_bias_update)
        layers.append(layer)
    return layers


def run_case(name: str, ceil: dict, tile_variants: dict) -> dict:
    preset, experts, ranks = CASES[name]
    log(f"[{name}] building {preset} with {experts} experts, {ranks} rank(s) x {TOKENS} tokens")
    torch.manual_seed(0)
    full = getattr(ExpertLayer, preset)(num_experts=experts, dtype=torch.bfloat16, device="cuda")
    full.requires_grad_(False)
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    xs = [torch.randn(TOKENS, full.config.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(ranks)]
    x_all = torch.cat(xs)

    with torch.no_grad():
        t_ref = timed(lambda: full(x_all))
        t_ref_sync = timed(lambda: full(x_all), queued=False)
        ref_out = full(x_all)
    log(f"[{name}] reference {t_ref * 1e3:.3f} ms (one synchronised call: {t_ref_sync * 1e3:.3f} ms)")
    t_gm = grouped_mm_alone(full, x_all)
    w = work(full.config, TOKENS * ranks, experts)
    roof = max(w["flops"] / (ceil["dense_tflops"] * 1e12), w["weight_bytes"] / (ceil["copy_gbps"] * 1e9))
    result = {
        "case": name, "tokens_per_rank": TOKENS, "ranks": ranks, "experts": experts, **w,
        "reference_ms": t_ref * 1e3, "reference_synchronised_call_ms": t_ref_sync * 1e3, "grouped_mm_ms": t_gm * 1e3,
        "grouped_mm_tflops": w["gemm_flops"] / t_gm / 1e12, "roofline_ms": roof * 1e3, "variants": {},
    }
    for label, tiles in tile_variants.items():
        world = EmulatedWorld(ranks, "cuda")
        layers = rank_layers(full, world, TOKENS, tiles, profile=False)
        call = lambda: world.run(lambda r, x: layers[r](x), xs)  # noqa: E731
        with torch.no_grad():
            t0 = time.time()
            outs = call()
            torch.cuda.synchronize()
            log(f"[{name}/{label}] first call (compile + run) {time.time() - t0:.1f} s")
            for layer in layers:
                layer.fused().raise_if_failed()
            agreement = disagreement(outs, ref_out)
            t_fused = timed(call)
            t_fused_sync = timed(call, queued=False)
            # A profiled run: the same kernel with per-task timers.
            for layer in layers:
                layer.fused().profile = layer.fused().new_profile()
            call()
            torch.cuda.synchronize()
        workers = layers[0].fused().workers
        report = [layer.fused().profile_report() for layer in layers]
        busy = {k: sum(rep[k]["seconds"] for rep in report) / (workers * ranks) for k in report[0]}
        gemm_s = sum(busy[k] for k in ("gate_up", "down", "shared_gate_up", "shared_down"))
        # Per routed tile: the mean task time and the part after its last dot. Tiles of two
        # reduction depths (gate/up H deep, down I deep) separate a per-step cost from a
        # per-tile one.
        tile_us = task_times(report, ("gate_up", "down"))
        ends = launch_ends([layer.fused() for layer in layers])
        v = {
            "tiles": dataclasses.asdict(tiles), "workers_per_rank": workers,
            "fused_ms": t_fused * 1e3, "speedup_vs_reference": t_ref / t_fused,
            "fused_synchronised_call_ms": t_fused_sync * 1e3,
            "synchronised_call_speedup_vs_reference": t_ref_sync / t_fused_sync,
            "roofline_fraction": roof / t_fused,
            # All workers of all ranks share the device, so the mean worker's GEMM time is the
            # device's GEMM time.
            "in_kernel_gemm_tflops": w["gemm_flops"] / gemm_s / 1e12 if gemm_s else 0.0,
            "per_worker_busy_ms": {k: s * 1e3 for k, s in busy.items()},
            "routed_tiles": tile_us,
            "launch_ends": ends,
            "max_abs_diff_vs_reference": agreement["max_abs"], "mean_abs_diff_vs_reference": agreement["mean_abs"],
            "disagreement_vs_reference": agreement,
        }
        v["in_kernel_gemm_vs_grouped_mm"] = v["in_kernel_gemm_tflops"] / result["grouped_mm_tflops"]
        result["variants"][label] = v
        log(f"[{name}/{label}] fused {t_fused * 1e3:.3f} ms, x{t_ref / t_fused:.2f} vs reference "
            f"(synchronised calls {t_fused_sync * 1e3:.3f} ms, x{t_ref_sync / t_fused_sync:.2f}), "
            f"{100 * roof / t_fused:.0f}% of roofline, GEMM {v['in_kernel_gemm_tflops']:.0f} TFLOP/s in kernel "
            f"vs grouped_mm {result['grouped_mm_tflops']:.0f}; busy ms "
            + ", ".join(f"{k} {s * 1e3:.3f}" for k, s in busy.items()) + "; per tile " + describe_task_times(tile_us)
            + "; " + describe_launch_ends(ends)
            + f"; output off the reference by {agreement['relative']:.2e} overall, {agreement['worst_row']:.2e} "
              "at worst in a row")
        if disagrees(agreement, token_rows=True):
            WRONG.append(f"{name}/{label}")
            log(f"[{name}/{label}] WRONG: the output disagrees with the reference beyond {AGREEMENT}: {agreement}")
        # Every name that reaches this world goes, the loops' last layer too: its fabric holds
        # the world and so every rank's workspace (stop 44: the second variant of dsv3_emulated8
        # ran out of an H100's memory beside the first one's 8 x 5 GB).
        del call, layers, layer, world, outs
        gc.collect()
        torch.cuda.empty_cache()
    del full
    torch.cuda.empty_cache()
    return result


def new_results() -> dict:
    """The results of a run before its cases: the device, the software it ran under and both
    ceilings, measured now (logged as they are found)."""
    ceil = ceilings()
    log(f"ceilings: dense bf16 matmul {ceil['dense_tflops']:.0f} TFLOP/s, copy {ceil['copy_gbps']:.0f} GB/s")
    env = environment(torch.device("cuda"))
    log(f"torch {env['torch']}, Triton {env['triton']} ({env['triton_path']})")
    return {"device": env["device"], "environment": env, "ceilings": ceil, "cases": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--tiles", action="store_true", help="also run the tile variants on each case")
    parser.add_argument("--variants", nargs="+", choices=list(TILE_VARIANTS), default=None,
                        help="run these tile variants (implies --tiles)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    EmulatedWorld.set_environment()  # before CUDA starts: require_cuda's device query reads CUDA_MODULE_LOADING
    require_cuda("layer_forward.py",
                 "benchmarks/kernel_resources.py compiles the kernels' tile variants for sm_90 without one")
    results = new_results()
    ceil = results["ceilings"]
    variants = TILE_VARIANTS if args.tiles else {"default": GPU_TILES}
    if args.variants:
        variants = {name: TILE_VARIANTS[name] for name in args.variants}
    for name in args.cases:
        results["cases"].append(run_case(name, ceil, variants))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print("Device time (the host queued ahead); in brackets one synchronised call each.")
    print(f"{'case':16} {'ref ms':>8} {'fused ms':>9} {'speedup':>8} {'roofline':>9} {'GEMM TF/s':>10} {'gmm TF/s':>9}"
          f" {'[ref ms':>8} {'fused ms':>9} {'speedup]':>9}")
    for r in results["cases"]:
        for label, v in r["variants"].items():
            print(f"{r['case'] + ('' if label == 'default' else '/' + label):16} {r['reference_ms']:8.3f} "
                  f"{v['fused_ms']:9.3f} {v['speedup_vs_reference']:8.2f} {100 * v['roofline_fraction']:8.0f}% "
                  f"{v['in_kernel_gemm_tflops']:10.0f} {r['grouped_mm_tflops']:9.0f} "
                  f"{r['reference_synchronised_call_ms']:8.3f} {v['fused_synchronised_call_ms']:9.3f} "
                  f"{v['synchronised_call_speedup_vs_reference']:9.2f}")
    exit_if_wrong()


def exit_if_wrong() -> None:
    """Exit with status 1, naming them, if any case's results disagreed with the reference."""
    if WRONG:
        log(f"results that disagree with the reference (timed anyway, not to be reported): {', '.join(WRONG)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
