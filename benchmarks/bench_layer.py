"""The whole expert layer, forward and forward+backward, for each backend and both real shapes.

    python benchmarks/bench_layer.py --out results/layer.json
    torchrun --nproc-per-node 8 benchmarks/bench_layer.py --out results/layer.json
    python benchmarks/bench_layer.py --smoke                  # CPU check of the script

4096 tokens per rank, bf16. With W ranks the layer holds all experts, sharded over the EP
group (DeepSeek-V3: 256, Qwen3-235B: 128); on one GPU it holds one EP8 rank's share (32 and
16), i.e. one rank's expert work without the exchange. Per backend and shape: forward time,
forward+backward time, their TFLOP/s (expert GEMMs, router and shared expert; x3 for
forward+backward), the ratio to the reference backend and the peak memory of a
forward+backward above the weights. Backends: reference (all-to-all), kosmos, and deepep when
``deep_ep`` imports (otherwise reported as skipped).
"""

from __future__ import annotations

import argparse

from common import ceilings, environment, init, log, markdown_table, timed, write

import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer

SHAPES = {"deepseek_v3": 256, "qwen3_235b": 128}


def flops(config, tokens: int) -> float:
    H, I, I_s, K, E = (config.hidden_size, config.moe_intermediate_size, config.shared_intermediate_size,
                       config.top_k, config.num_experts)
    return 6 * tokens * K * H * I + 6 * tokens * H * I_s + 2 * tokens * H * E


def run(preset: str, backend: str, args, device, world: int) -> dict:
    experts = SHAPES[preset] if world > 1 else SHAPES[preset] // 8
    overrides = dict(num_experts=experts, dtype=torch.float32 if args.smoke else torch.bfloat16, device=device)
    if args.smoke:
        overrides.update(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2,
                         **({"n_group": 2, "topk_group": 1} if preset == "deepseek_v3" else {}))
    if backend == "kosmos":
        overrides.update(max_tokens_per_rank=args.tokens)
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    layer = getattr(ExpertLayer, preset)(backend=backend, group=group, **overrides)
    x = torch.randn(args.tokens, layer.config.hidden_size, device=device, dtype=overrides["dtype"])
    g = torch.randn_like(x) * 1e-2
    xg = x.clone().requires_grad_()

    def forward():
        with torch.no_grad():
            layer(x)

    def train_step():
        for p in layer.parameters():
            p.grad = None
        xg.grad = None
        torch.autograd.backward(layer(xg), g)

    t_fwd = timed(forward, device, args.warmup, args.iters)
    t_step = timed(train_step, device, args.warmup, args.iters)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    f = flops(layer.config, args.tokens)
    row = {"shape": preset, "backend": backend, "experts": layer.config.num_experts, "ranks": world,
           "forward_ms": t_fwd * 1e3, "train_ms": t_step * 1e3,
           "forward_tflops": f / t_fwd / 1e12, "train_tflops": 3 * f / t_step / 1e12, "peak_gib": peak}
    log(f"[{preset}/{backend}] forward {t_fwd * 1e3:.3f} ms, forward+backward {t_step * 1e3:.3f} ms")
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--backends", nargs="+", default=["reference", "kosmos", "deepep"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.warmup, args.iters = 24, 1, 1
    device = init(args.smoke)
    world = dist.get_world_size()
    ceil = ceilings(device, args.smoke)
    log(f"ceilings: {ceil}")
    rows = []
    for preset in args.shapes:
        ref_row = None
        for backend in args.backends:
            try:
                row = run(preset, backend, args, device, world)
            except ImportError as error:
                log(f"[{preset}/{backend}] skipped: {str(error).splitlines()[0]}")
                rows.append({"shape": preset, "backend": backend, "skipped": "not importable"})
                continue
            if backend == "reference":
                ref_row = row
            if ref_row is not None:
                row["forward_vs_reference"] = ref_row["forward_ms"] / row["forward_ms"]
                row["train_vs_reference"] = ref_row["train_ms"] / row["train_ms"]
            rows.append(row)
    results = {"environment": environment(device), "ceilings": ceil, "args": vars(args), "rows": rows}
    table = markdown_table(rows, [
        ("shape", "shape", ""), ("backend", "backend", ""), ("experts", "experts", "d"), ("ranks", "ranks", "d"),
        ("forward_ms", "fwd ms", ".3f"), ("forward_tflops", "fwd TFLOP/s", ".0f"),
        ("forward_vs_reference", "fwd vs ref", ".2f"), ("train_ms", "fwd+bwd ms", ".3f"),
        ("train_tflops", "fwd+bwd TFLOP/s", ".0f"), ("train_vs_reference", "fwd+bwd vs ref", ".2f"),
        ("peak_gib", "peak GiB", ".2f"), ("skipped", "skipped", ""),
    ])
    write(results, table, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
