"""Training-step time of the DeepSeek-V3 and Qwen3-235B proxies on one GPU: kosmos against reference.

Each case builds a 2-layer proxy at the real layer shapes (bf16 parameters), feeds it 4096
tokens per step (batch 1 x seq 4096 by default) and times whole training steps with each MoE
backend, in the same run and from the same initial weights. Per case and backend: the median
step time, tokens/s, MFU (model FLOPs as in ``proxies/flops.py``: 6 x active parameters x
tokens + causal attention, against ``--peak-tflops``, default 989 = H100/H200 bf16 dense),
the peak memory (``torch.cuda.max_memory_allocated``) and the first step's loss (the two
backends must agree to bf16 rounding); and the kosmos/reference speedup.

    python benchmarks/bench_e2e.py --out bench_e2e.json
    python benchmarks/bench_e2e.py --cases dsv3_rank qwen3_rank --iters 10

What fits on one H200 (141 GB), and hence the cases. The DeepSeek-V3 proxy (dense first layer,
one MoE layer, MLA in both, vocab 129280) has 13.9 B parameters with all 256 experts, 11.3 B of
them routed experts. A full training step keeps bf16 weights (2 B/param), fp32 master weights
and their gradients (8 B/param), AdamW's two fp32 moments (8 B/param) and, for the step
itself, multi-tensor AdamW's fp32 temporary of its larger parameter group (about 4 B/param):
about 22 B/param, 307 GB (``proxies/memory.py``; the bf16 gradients are freed as they move to
the masters). That does not fit, so:

* ``dsv3_rank``: the full step (forward, backward, fp32-master AdamW, clipping, bias update)
  with 32 experts, one EP8 rank's share: 4.1 B parameters, 89.7 GB of state at the optimizer
  step: an H200 only (on an 80 GB H100 it ran out of memory in its first AdamW step, stop 30;
  a case whose weights, gradients and optimizer state exceed the free memory is reported as
  not fitting, before it is built).
  At 4096 tokens and top-8 the 32 experts see 32768 rows, 1024 per expert on average, which
  is exactly the expert work of one EP8 rank whose 8 ranks each route 4096 tokens (the
  all-to-all itself is absent: one GPU). The router chooses top-8 among the 32 (8 groups of 4,
  top-4 groups), so routing differs from 256-way but the GEMM shapes are the rank's.
* ``dsv3_full``: all 256 experts, forward + backward only (no optimizer state): 13.9 B
  parameters, 56 GB of bf16 weights and gradients, plus activations. Expert weights are read
  at EP=1 from one GPU, which makes the MoE layer bound by weight bandwidth.
* ``qwen3_rank`` (16 experts, EP8 share, full step: 2.0 B parameters) and ``qwen3_full``
  (128 experts, 6.2 B parameters, 137 GB for a full step: forward + backward only) likewise.

``--smoke`` runs the same cases on the tiny presets (on the CPU without a GPU; the kosmos
backend there needs ``TRITON_INTERPRET=1``): a check of this script, not a measurement.

The optimizer step is timed inside the full step; without it, the step is forward + backward
+ zeroing the gradients. The kosmos backend is built with ``max_tokens_per_rank = batch *
seq``; its first step compiles the kernels and is not timed (``--warmup`` steps are not).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

# First: with --smoke it switches Triton's interpreter on (the kosmos backend on the CPU) before
# Triton is imported, and it puts the repository root (`proxies`) on the path.
from common import require_cuda

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from proxies import MoERuntime, build_model, get_config  # noqa: E402
from proxies.data import Loader, SyntheticTokens  # noqa: E402
from proxies.flops import active_params, flops_per_token, total_params  # noqa: E402
from proxies.memory import backward_memory, shortfall, step_memory  # noqa: E402
from proxies.models import build_skeleton  # noqa: E402
from proxies.optim import MasterWeights, build_adamw  # noqa: E402
from proxies.parallel import Parallel, clip_grad_norm  # noqa: E402

CASES = {
    # name: (preset, experts per MoE layer, with the optimizer step)
    "dsv3_rank": ("deepseek_v3", 32, True),
    "qwen3_rank": ("qwen3_235b", 16, True),
    "dsv3_full": ("deepseek_v3", 256, False),
    "qwen3_full": ("qwen3_235b", 128, False),
}


class DoesNotFit(Exception):
    """The case's training state exceeds the GPU's free memory (proxies/memory.py)."""


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


SMOKE = {"deepseek_v3": "deepseek_v3_tiny", "qwen3_235b": "qwen3_tiny"}


def _case_config(name: str, args):
    preset, experts, _ = CASES[name]
    overrides = {"n_layers": args.layers, "moe": {"num_experts": experts}}
    if args.smoke:  # the tiny preset, with its own 8 experts
        preset, overrides = SMOKE[preset], {"n_layers": args.layers}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    return get_config(preset, **overrides)


def run_backend(name: str, backend: str, args) -> dict:
    _, _, with_optimizer = CASES[name]
    config = _case_config(name, args)
    tokens = args.batch * args.seq_len
    runtime = MoERuntime(backend=backend, max_tokens_per_rank=tokens)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:  # a step that cannot fit is reported, not built (a minute of GPU time)
        skeleton = build_skeleton(config, runtime, dtype=torch.bfloat16)
        need = step_memory(skeleton, multi_tensor=True) if with_optimizer else backward_memory(skeleton)
        why = shortfall(need, torch.cuda.mem_get_info(device)[0], str(device))
        if why:
            raise DoesNotFit(why)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(config, runtime, device=device, dtype=torch.bfloat16 if cuda else torch.float32, seed=0)
    log(f"[{name}/{backend}] built {total_params(model) / 1e9:.2f} B params in {time.perf_counter() - t0:.1f} s")
    masters = optimizer = None
    if with_optimizer:
        masters = MasterWeights(model)
        optimizer = build_adamw(masters, lr=1e-5, weight_decay=0.1)
    biased = [m for m in model.moe_layers() if m.gate.e_score_correction_bias is not None]
    single = Parallel(rank=0, world=1, ep=1, ep_group=None, dp_group=None)
    inputs, targets = Loader(SyntheticTokens(config.vocab_size, args.seq_len, seed=0), args.batch, device=device).next()

    def step() -> torch.Tensor:
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        del logits
        if with_optimizer:
            named = masters.grads_to_master()
            clip_grad_norm(named, 1.0, single)
            optimizer.step()
            masters.copy_to_model()
            masters.zero_grad()
        else:
            model.zero_grad(set_to_none=True)
        for layer in biased:
            layer.update_router_bias()
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first_loss = step().item()
    sync()
    log(f"[{name}/{backend}] first step (compile + run) {time.perf_counter() - t0:.1f} s, loss {first_loss:.4f}")
    for _ in range(args.warmup - 1):
        step()
    times = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    for layer in model.moe_layers():
        if layer.backend == "kosmos":
            layer.fused().raise_if_failed()
    t = statistics.median(times)
    fpt = flops_per_token(model, args.seq_len)
    result = {
        "backend": backend, "step_ms": t * 1e3, "step_ms_all": [x * 1e3 for x in times],
        "tokens_per_s": tokens / t, "mfu": fpt * tokens / t / (args.peak_tflops * 1e12),
        "model_tflops": fpt * tokens / t / 1e12,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "first_loss": first_loss, "params_total": total_params(model), "params_active": active_params(model),
        "flops_per_token": fpt,
    }
    log(f"[{name}/{backend}] {t * 1e3:.1f} ms/step, {tokens / t:,.0f} tok/s, MFU {100 * result['mfu']:.1f}%, "
        f"peak memory {result['max_memory_gib']:.1f} GiB")
    del model, masters, optimizer, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--backends", nargs="+", default=["reference", "kosmos"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the real model's")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU peak for MFU (bf16 dense H100/H200)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny presets, to check the script (CPU if no GPU)")
    args = p.parse_args()
    if not args.smoke:
        require_cuda("bench_e2e.py", "--smoke runs the tiny presets on the CPU")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from kosmos_moe import BACKENDS

    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; this kosmos_moe provides {', '.join(BACKENDS)}")

    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "smoke": args.smoke, "batch": args.batch,
               "seq_len": args.seq_len, "layers": args.layers, "peak_tflops": args.peak_tflops, "cases": {}}
    for name in args.cases:
        config = _case_config(name, args)
        case = {"preset": config.name, "experts": config.moe.num_experts, "optimizer_step": CASES[name][2],
                "backends": {}}
        for backend in args.backends:
            try:
                case["backends"][backend] = run_backend(name, backend, args)
            except DoesNotFit as e:
                log(f"[{name}/{backend}] not run: {e}")
                case["backends"][backend] = {"backend": backend, "error": "does not fit", "why": str(e)}
            except torch.cuda.OutOfMemoryError as e:
                log(f"[{name}/{backend}] out of memory: {str(e).splitlines()[0]}")
                case["backends"][backend] = {"backend": backend, "error": "out of memory"}
                gc.collect()
                torch.cuda.empty_cache()
        ref, kos = case["backends"].get("reference", {}), case["backends"].get("kosmos", {})
        if "step_ms" in ref and "step_ms" in kos:
            case["kosmos_speedup"] = ref["step_ms"] / kos["step_ms"]
            case["first_loss_rel_diff"] = abs(kos["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
        results["cases"][name] = case
        if args.out:  # after every case, so that a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=1))

    print(f"{'case':12s} {'backend':10s} {'ms/step':>9s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s}  speedup")
    for name, case in results["cases"].items():
        for backend, r in case["backends"].items():
            if "error" in r:
                print(f"{name:12s} {backend:10s} {r['error']}")
                continue
            speed = f"x{case['kosmos_speedup']:.2f}" if backend == "kosmos" and "kosmos_speedup" in case else ""
            print(f"{name:12s} {backend:10s} {r['step_ms']:9.1f} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}% "
                  f"{r['max_memory_gib']:9.1f}  {speed}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
