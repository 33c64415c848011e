"""Forward + backward of the whole expert layer on one GPU: the fused kernels against the reference.

Same cases and ceilings as ``layer_forward.py``, in the same run. Per case: the time of one
forward+backward of each backend, their ratio, the fused path's fraction of the roofline
``max(3 x forward FLOPs / dense rate, 3 x expert-weight bytes / copy bandwidth)`` (weights are
read in the forward, read again in the backward and their gradients written), the peak memory
of a training step of each backend above the weights, and the bytes autograd saves per token.

    python benchmarks/layer_backward.py --out results.json
    python benchmarks/layer_backward.py --cases dsv3_rank --profile
    python benchmarks/layer_backward.py --cases dsv3_rank --trace     # every kernel of one step

A case that runs out of GPU memory is reported as skipped and the run goes on: on one H200,
``dsv3_emulated8`` does (the reference's step, then eight ranks' worst-case workspaces of
about 10.5 GB each next to the 256 experts' weights and gradients).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from torch import nn

from common import AGREEMENT, disagreement, disagrees, require_cuda
from layer_forward import (CASES, TOKENS, WRONG, describe_launch_ends, describe_task_times, exit_if_wrong, launch_ends,
                           log, new_results, task_times, timed, work)

from kosmos_moe import ExpertLayer
from kosmos_moe.activation_memory import saved_bytes
from kosmos_moe.fabric import EmulatedWorld
from kosmos_moe.workspace import GPU_BACKWARD_TILES, GPU_BACKWARD_TILES_TWO_PER_SM, GPU_TILES

# Variants (--variants): the fused layer's options (``FusedForward``'s keyword arguments) that
# differ from the default. The backward's dx and SwiGLU-backward tiles read their weights by
# plain loads: TMA weight blocks made them slower on the H200 (8.8 vs 8.2 and 5.1 vs 4.8 ms
# per worker, DeepSeek-V3 one-rank view), and so did TMA for both operands (``tile_tma``).
# Host descriptors for their weights with 256-byte L2 promotion, as the forward's, did not help
# where the weights stream from HBM either (H100 80GB, stop 45, forward+backward ms against
# pointer loads: DeepSeek-V3 256 experts 36.09 / 35.64, Qwen3 128 experts 11.11 / 11.03).
# The tile variants change one backward tile size each; those that an offline sm_90 compile
# showed to serialize the kernel's wgmma for lack of registers (ptxas C7512: 128 x 256 or
# 256 x 128 weight-gradient tiles beside the default router-gradient tiles, 128-column
# SwiGLU-backward tiles with three accumulators, recompute_cols=128) or to need more than
# 227 KB of shared memory (4 stages at depth 64 or 32) are left out. ``recompute`` keeps no
# gate/up projections in the forward (``save_gate_up=0``): the backward redoes them.
def _backward_tiles(**changes) -> dict:
    return {"backward_tiles": dataclasses.replace(GPU_BACKWARD_TILES, **changes)}


VARIANTS = {
    "default": {},
    "recompute": {"save_gate_up": 0.0},
    # The shared experts' backward redoes their forward under autograd (the default before
    # their projections were kept).
    "shared_recompute": {"save_shared": False},
    "saved_cols64": _backward_tiles(swiglu_cols=64),
    "pointer_weights": {"tiles": dataclasses.replace(GPU_TILES, tma=False)},
    # Eight and four column blocks per weight-gradient task: at DeepSeek-V3 32 experts 7 tasks
    # share each dW[g;u] row block at 4 and 2 each dWd row block (2 and 1 at 16 blocks), so
    # fewer of the row blocks that every task rereads for each of its blocks are in use at once.
    # Stop 50 (H100 80GB): strip4 read 4.6 GB less from DRAM in the DeepSeek-V3 32-expert
    # backward but took as long; strip8 was 2% faster at Qwen3 16 experts, 1% at 128, 0.8%
    # slower at DeepSeek-V3 256 and even at 32 (BackwardTiles.wgrad_strip). Since stop 56 the
    # default holds 8 where 16 would be a whole row (Qwen3), so strip8 differs at DeepSeek-V3 only.
    "strip8": _backward_tiles(wgrad_strip=8),
    # 16 blocks a task at every width: the default until stop 56.
    "strip16": _backward_tiles(wgrad_split_whole_rows=False),
    "strip4": _backward_tiles(wgrad_strip=4),
    "rows64": _backward_tiles(rows=64),
    "dx_stages3": _backward_tiles(dx_stages=3),
    "depth32": _backward_tiles(depth=32),
    "wgrad_k32_stages4": _backward_tiles(wgrad_depth=32, wgrad_stages=4),
    "wgrad_pointers": _backward_tiles(wgrad_tma=False),
    "tile_tma": _backward_tiles(tile_tma=True),
    # The default until stop 32: 128 x 128 weight-gradient tiles in 4 stages beside 128 x 128
    # router-gradient tiles (128 x 256 ones beside those make ptxas serialize every wgmma, C7512).
    "wgrad_cols128": _backward_tiles(wgrad_cols=128, wgrad_stages=4, router_grad_rows=128, router_grad_cols=128),
    # The router-gradient reduction 64 tokens a step (the default until stop 33; 32 spills less).
    "router_depth64": _backward_tiles(router_grad_depth=64),
    # 64 x 64 router-gradient tiles (the default until stop 35).
    "router_grad64": _backward_tiles(router_grad_rows=64, router_grad_cols=64),
    # Weight-gradient blocks stored by TMA: its staging tile leaves room for 3 stages only
    # (213,016 B of shared memory; 262,176 with 4).
    "wgrad_tma_store": _backward_tiles(wgrad_tma_store=True, wgrad_stages=3),
    # The same stores beside 32-row steps, whose stages (24 KB) leave room for 6 (213,040 B):
    # the blocks' fill waits for half the bytes and the store leaves the loop's path (stop 42:
    # time after the loops 3.21 against 1.00 ms at 256 experts, but 3 stages slowed the loops).
    # Then 32-row steps, 8 stages, stored by pointer: the shorter fill alone. Neither pays: H100
    # 80GB, Triton 3.9, stop 58, forward+backward ms, default / these two, one process: Qwen3 16
    # experts 7.27 / 7.26 / 7.27, DeepSeek-V3 32 17.59 / 17.63 / 17.69, Qwen3 128 10.56 / 10.70 /
    # 10.85, DeepSeek-V3 256 34.60 / 35.33 / 35.34.
    "wgrad_k32_tma_store": _backward_tiles(wgrad_tma_store=True, wgrad_depth=32, wgrad_stages=6),
    "wgrad_k32_stages8": _backward_tiles(wgrad_depth=32, wgrad_stages=8),
    # 128-row steps in 2 stages (96 KB each; 196,624 B of shared memory): one or two steps a block
    # where experts have about 128-256 rows (256 and 128 experts), so fewer fills, waits and
    # wgmma groups a block. Slower everywhere: H100 80GB, Triton 3.9, stop 58, forward+backward
    # ms, default / this, two processes at 128 and 256 experts: Qwen3 128 experts 10.39 / 11.04
    # and 10.48 / 10.99, DeepSeek-V3 256 34.09 / 35.85 and 34.24 / 35.63, Qwen3 16 7.18 / 8.10,
    # DeepSeek-V3 32 17.39 / 19.46.
    "wgrad_k128_stages2": _backward_tiles(wgrad_depth=128, wgrad_stages=2),
    # The tiles of stop 33: one flat loop per weight-gradient strip, beside which 256-column
    # dx and SwiGLU-backward tiles do not compile without C7512 (offline sm_90, Triton 3.6),
    # and 64 x 64 router-gradient tiles.
    "flat_strips": _backward_tiles(wgrad_block_loops=False, dx_cols=128, swiglu_cols=128, wgrad_stages=3,
                                   router_grad_rows=64, router_grad_cols=64),
    "dx_cols128": _backward_tiles(dx_cols=128),
    "swiglu_cols128": _backward_tiles(swiglu_cols=128),
    # Three weight-gradient stages (the default until stop 34; four fit in shared memory
    # beside per-block loops).
    "wgrad_stages3": _backward_tiles(wgrad_stages=3),
    # The route backward's d logits @ Wr unpipelined.
    "route_stages1": _backward_tiles(route_stages=1),
    # The route backward's d logits @ Wr with three copies in flight: slower than one (stop 38,
    # H100, route backward 0.167 against 0.131 ms busy per worker at DeepSeek-V3 32 experts).
    "route_stages4": _backward_tiles(route_stages=4),
    # The weight-gradient blocks stored without the L2 evict-first policy (the default until
    # stop 42).
    "wgrad_keep_in_l2": _backward_tiles(wgrad_evict_first=False),
    # The default from 128 local experts (kosmos_moe.workspace.gpu_backward_tiles), named to time
    # either at any expert count: one worker of two warpgroups per SM (the tiles the variants
    # above change), and two workers of one warpgroup per SM.
    "one_per_sm": {"backward_tiles": GPU_BACKWARD_TILES},
    "two_per_sm": {"backward_tiles": GPU_BACKWARD_TILES_TWO_PER_SM},
    # Those with the SwiGLU-backward tiles in 2 stages: with several ranks, where the kernel also
    # compiles the tiles that redo projections, 3 stages take 135,168 B of shared memory (one
    # block per SM) and 2 take 98,328 (offline sm_90a, Triton 3.9, Qwen3 128 experts over 2 ranks,
    # spills 1,232 / 1,904 B). Untimed: what 2 stages cost the kept-projection tiles at one rank.
    "two_per_sm_stages2": {"backward_tiles": dataclasses.replace(GPU_BACKWARD_TILES_TWO_PER_SM, stages=2)},
}


def rank_layers(full: ExpertLayer, world: EmulatedWorld, max_tokens: int, profile: bool,
                variant: str = "default") -> list[ExpertLayer]:
    """Trainable emulated ranks; expert weights are views of the full layer's, the router is shared."""
    shape = dataclasses.asdict(full.config)
    positional = [shape.pop(k) for k in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k")]
    layers = []
    for r in range(world.world_size):
        with torch.device("meta"):
            layer = ExpertLayer(*positional, **shape, backend="kosmos", fabric=world.rank(r),
                                max_tokens_per_rank=max_tokens, dtype=torch.bfloat16,
                                fused_options={"profile": profile, "backward": True, **VARIANTS[variant]})
        first, last = layer.local_expert_range
        layer.gate = full.gate
        layer.shared_experts = full.shared_experts
        layer.experts.gate_up_proj = nn.Parameter(full.experts.gate_up_proj.detach()[first:last])
        layer.experts.down_proj = nn.Parameter(full.experts.down_proj.detach()[first:last])
        layer.tokens_per_expert = torch.zeros_like(full.tokens_per_expert)
        layer.load_since_bias_update = torch.zeros_like(full.load_since_bias_update)
        layers.append(layer)
    return layers


def peak_above(step) -> float:
    """Peak bytes allocated during ``step()`` above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def kernel_breakdown(step, top: int = 12) -> list[dict]:
    """Device time of every kernel that one ``step()`` launches, by kernel name, largest first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = rows.setdefault(event.name, {"kernel": event.name, "ms": 0.0, "calls": 0})
            row["ms"] += event.time_range.elapsed_us() / 1e3
            row["calls"] += 1
    ranked = sorted(rows.values(), key=lambda r: -r["ms"])
    rest = ranked[top:]
    if rest:
        ranked = ranked[:top] + [{"kernel": f"({len(rest)} others)", "ms": sum(r["ms"] for r in rest),
                                  "calls": sum(r["calls"] for r in rest)}]
    return ranked


def log_breakdown(label: str, ranked: list[dict]) -> None:
    total = sum(r["ms"] for r in ranked)
    log(f"{label}: {total:.3f} ms of kernels")
    for r in ranked:
        log(f"    {r['ms']:8.3f} ms {r['calls']:5d} x  {r['kernel'][:110]}")


def run_case(name: str, ceil: dict, profile: bool, variant: str = "default", trace: bool = False) -> dict:
    preset, experts, ranks = CASES[name]
    log(f"[{name}] building {preset} with {experts} experts, {ranks} rank(s) x {TOKENS} tokens")
    torch.manual_seed(0)
    full = getattr(ExpertLayer, preset)(num_experts=experts, dtype=torch.bfloat16, device="cuda")
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    hidden = full.config.hidden_size
    xs = [torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(ranks)]
    gs = [torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16) * 1e-2 for _ in range(ranks)]
    x_all = torch.cat([x.detach() for x in xs]).requires_grad_()
    g_all = torch.cat(gs)
    params = list(full.parameters())

    def clear(*tensors):
        for t in (*params, *tensors):
            t.grad = None

    def ref_step():
        clear(x_all)
        torch.autograd.backward(full(x_all), g_all)

    t_ref = timed(ref_step, warmup=2, iters=6)
    t_ref_sync = timed(ref_step, warmup=0, iters=6, queued=False)
    ref_peak = peak_above(ref_step)
    ref_saved = saved_bytes(lambda: full(x_all), full)
    # bf16 copies: fp32 copies of the DeepSeek-V3 expert gradients alone would take 45 GB.
    ref_grads = (x_all.grad.clone(), full.experts.gate_up_proj.grad.clone(), full.experts.down_proj.grad.clone(),
                 full.gate.weight.grad.float())
    log(f"[{name}] reference fwd+bwd {t_ref * 1e3:.3f} ms, peak {ref_peak / 2**30:.2f} GiB above the weights")

    world = EmulatedWorld(ranks, "cuda")
    layers = rank_layers(full, world, TOKENS, profile=False, variant=variant)

    def fused_step():
        clear(*xs, *(p for layer in layers for p in layer.experts.parameters()))
        world.run(lambda r, x, g: torch.autograd.backward(layers[r](x), g), xs, gs)

    t0 = time.time()
    for layer in layers:
        layer.fused().prepare(torch.bfloat16)
    if ranks > 1:
        # Every GEMM the host runs while a rank's kernel waits for a peer must have run once (EmulatedWorld).
        world.rehearse(full, [x.detach() for x in xs], gs)
    fused_step()
    torch.cuda.synchronize()
    for layer in layers:
        layer.fused().raise_if_failed()
    log(f"[{name}] fused first step (compile + run) {time.time() - t0:.1f} s")
    t_fused = timed(fused_step, warmup=1, iters=6)
    t_fused_sync = timed(fused_step, warmup=0, iters=6, queued=False)
    fused_peak = peak_above(fused_step)
    fused_saved = sum(saved_bytes(lambda r=r: layers[r](xs[r]), full) for r in range(ranks))
    # Each gradient: the fused ranks' parts, the reference's whole, whether its rows are tokens'.
    grads = {
        "dx": ([x.grad for x in xs], ref_grads[0], True),
        "d_gate_up": ([layer.experts.gate_up_proj.grad for layer in layers], ref_grads[1], False),
        "d_down": ([layer.experts.down_proj.grad for layer in layers], ref_grads[2], False),
        "d_router": ([full.gate.weight.grad], ref_grads[3], False),
    }
    agreement = {k: disagreement(parts, whole) for k, (parts, whole, _) in grads.items()}
    err = {k: a["max_abs"] for k, a in agreement.items()}
    wrong = [k for k, (_, _, token_rows) in grads.items() if disagrees(agreement[k], token_rows)]
    del grads
    workspace = sum(layer.fused().layout.nbytes + layer.fused().backward.layout.nbytes for layer in layers)

    w = work(full.config, TOKENS * ranks, experts)
    roof = max(3 * w["flops"] / (ceil["dense_tflops"] * 1e12), 3 * w["weight_bytes"] / (ceil["copy_gbps"] * 1e9))
    result = {
        "case": name, "tiles": variant, "tokens_per_rank": TOKENS, "ranks": ranks, "experts": experts, **w,
        "reference_ms": t_ref * 1e3, "fused_ms": t_fused * 1e3, "speedup_vs_reference": t_ref / t_fused,
        "reference_synchronised_call_ms": t_ref_sync * 1e3, "fused_synchronised_call_ms": t_fused_sync * 1e3,
        "synchronised_call_speedup_vs_reference": t_ref_sync / t_fused_sync,
        "roofline_ms": roof * 1e3, "roofline_fraction": roof / t_fused,
        "reference_peak_gib": ref_peak / 2**30, "fused_peak_gib": fused_peak / 2**30,
        "fused_workspace_gib": workspace / 2**30,
        "reference_saved_bytes_per_token": ref_saved / (TOKENS * ranks),
        "fused_saved_bytes_per_token": fused_saved / (TOKENS * ranks),
        "max_abs_diff_vs_reference": err,
        "disagreement_vs_reference": agreement,
    }
    log(f"[{name}/{variant}] fused fwd+bwd {t_fused * 1e3:.3f} ms, x{t_ref / t_fused:.2f} vs reference "
        f"{t_ref * 1e3:.3f} ms (synchronised steps {t_fused_sync * 1e3:.3f} vs {t_ref_sync * 1e3:.3f} ms, "
        f"x{t_ref_sync / t_fused_sync:.2f}), "
        f"{100 * roof / t_fused:.0f}% of roofline; peak {fused_peak / 2**30:.2f} GiB (workspaces "
        f"{workspace / 2**30:.2f} GiB, allocated once) vs {ref_peak / 2**30:.2f}; saved per token "
        f"{fused_saved / (TOKENS * ranks):.0f} B vs {ref_saved / (TOKENS * ranks):.0f} B; max diff {err}; off the "
        "reference overall (worst row) " + ", ".join(f"{k} {a['relative']:.2e} ({a['worst_row']:.2e})"
                                                     for k, a in agreement.items()))
    if wrong:
        WRONG.append(f"{name}/{variant}")
        log(f"[{name}/{variant}] WRONG: {', '.join(wrong)} disagree with the reference beyond {AGREEMENT}")
    if trace:
        result["reference_kernels"] = kernel_breakdown(ref_step)
        result["fused_kernels"] = kernel_breakdown(fused_step)
        log_breakdown(f"[{name}] reference step", result["reference_kernels"])
        log_breakdown(f"[{name}/{variant}] fused step", result["fused_kernels"])
    if profile:
        for layer in layers:
            layer.fused().profile = layer.fused().new_profile()
            layer.fused().backward.profile = layer.fused().backward.new_profile()
        fused_step()
        torch.cuda.synchronize()
        for key, launch in (("forward", lambda l: l.fused()), ("backward", lambda l: l.fused().backward)):
            reports = [launch(layer).profile_report() for layer in layers]
            workers = launch(layers[0]).workers
            busy = {k: sum(rep[k]["seconds"] for rep in reports) / (workers * ranks) * 1e3 for k in reports[0]}
            result[f"{key}_per_worker_busy_ms"] = busy
            log(f"[{name}] {key} busy ms per worker: " + ", ".join(f"{k} {v:.3f}" for k, v in busy.items()))
            ends = launch_ends([launch(layer) for layer in layers])
            result[f"{key}_launch_ends"] = ends
            log(f"[{name}] {key} " + describe_launch_ends(ends))
            if key == "backward":
                # Per GEMM task: the mean time and, for the kept-projection SwiGLU-backward and
                # the dx tiles, the part after the last dot (the recomputing tiles have no timer);
                # for the weight-gradient tasks, their blocks' time from the end of each block's
                # loop to its store's issue (per-block loops only).
                per_task = task_times(reports, ("swiglu_backward", "dx", "weight_grad"))
                result["backward_per_task"] = per_task
                log(f"[{name}] backward per task: " + describe_task_times(per_task))
    del layers, world, full
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--profile", action="store_true", help="also run a profiled step (per-task busy time)")
    parser.add_argument("--trace", action="store_true", help="also list the kernels of one step of each backend")
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                        help="tile variants of the fused layer to run on each case")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    EmulatedWorld.set_environment()  # before CUDA starts: require_cuda's device query reads CUDA_MODULE_LOADING
    require_cuda("layer_backward.py",
                 "benchmarks/kernel_resources.py compiles the kernels' tile variants for sm_90 without one")
    results = new_results()
    ceil = results["ceilings"]
    for name in args.cases:
        for variant in args.variants:
            failed = None
            try:
                results["cases"].append(run_case(name, ceil, args.profile, variant, args.trace))
            except torch.OutOfMemoryError as e:
                failed = str(e).splitlines()[0]
            if failed:  # outside the handler: its traceback holds the case's tensors
                torch.cuda.empty_cache()
                log(f"[{name}/{variant}] did not fit in GPU memory, skipped: {failed}")
                results["cases"].append({"case": name, "tiles": variant, "error": f"out of memory: {failed}"})
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(f"{'case':16} {'tiles':15} {'ref ms':>8} {'fused ms':>9} {'speedup':>8} {'roofline':>9} {'ref GiB':>8} {'fused GiB':>9} "
          f"{'ref B/tok':>10} {'fused B/tok':>11}")
    for r in results["cases"]:
        if "error" in r:
            print(f"{r['case']:16} {r['tiles']:15} {r['error']}")
            continue
        print(f"{r['case']:16} {r['tiles']:15} {r['reference_ms']:8.2f} {r['fused_ms']:9.2f} {r['speedup_vs_reference']:8.2f} "
              f"{100 * r['roofline_fraction']:8.0f}% {r['reference_peak_gib']:8.2f} {r['fused_peak_gib']:9.2f} "
              f"{r['reference_saved_bytes_per_token']:10.0f} {r['fused_saved_bytes_per_token']:11.0f}")
    exit_if_wrong()


if __name__ == "__main__":
    main()
