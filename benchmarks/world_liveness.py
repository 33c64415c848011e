"""Which launch patterns of an emulated world finish: a bisection of the world-stall failures.

The fused forward+backward in an emulated world (R ranks on one GPU, one stream each) timed
out on the H200 in the backward GPU tests at worlds 2, 4 and 8, while forward-only worlds of
up to 8 ranks pass. Two causes were told apart by the launch log (``kosmos_moe.fused`` at
DEBUG): host stalls of 1.6-6 s between two ranks' launches of a first call (CUDA loading a
torch or cuBLAS module, which waits for the running persistent kernels), and, with
``CUDA_MODULE_LOADING=EAGER`` and every launch issued within 0.2 s, a world of 8 whose rank-0
backward still waited in vain for rank 4's. This script runs one world per variant, each in a
fresh process (the environment variables act at CUDA initialisation) with a time limit, and
prints per variant: finished or not, the kernel's timeout record, and the largest host gap
between two consecutive launches.

    python benchmarks/world_liveness.py --world 8 --case softmax
    python benchmarks/world_liveness.py --world 2 --case shared --variants fused eager rehearse

Variants (``--variants``, default all):
  fused          each rank's forward then backward on its stream (the tests' pattern)
  split          every rank's forward, then every rank's backward
  eager          fused, with CUDA_MODULE_LOADING=EAGER
  connections32  fused, with CUDA_DEVICE_MAX_CONNECTIONS=32 (streams share fewer hardware queues)
  rank_leaves    fused, the input leaves made on the rank's stream, so autograd accumulates
                 their gradients there, not on the caller's stream
  half_workers   fused, half the workers per rank (SM residency to spare)
  rehearse       fused, after every rank's batch went through the reference layer once
  eager_rehearse eager + rehearse
  eager_split    eager + split
  eager_connections32  eager + connections32
  rehearse_rank_leaves rehearse + rank_leaves
  half_workers_rehearse half_workers + rehearse
  recommended    rehearse, started with EmulatedWorld.ENVIRONMENT (what the tests do)
  recommended_split, recommended_half  recommended + split, recommended + half_workers
  fresh_grads    rehearse, and every parameter's .grad set to None before the second call
  pre_gemm       rehearse, and a cuBLAS GEMM on every rank's output gradient, which autograd
                 queues on the rank's stream just before its fused backward
  pre_gemm_eager pre_gemm with CUDA_MODULE_LOADING=EAGER
  pre_gemm_connections32 pre_gemm with CUDA_DEVICE_MAX_CONNECTIONS=32
  pre_exp        rehearse, and an elementwise kernel (no GEMM) in the same place as pre_gemm's
  post_gemm      rehearse, and a cuBLAS GEMM on every rank's output, right after its fused
                 forward (issued by the caller's thread, not autograd's)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from common import require_cuda

from kosmos_moe.fabric import EmulatedWorld

VARIANTS = {
    "fused": {},
    "split": {"pattern": "split"},
    "eager": {"env": {"CUDA_MODULE_LOADING": "EAGER"}},
    "connections32": {"env": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}},
    "rank_leaves": {"rank_leaves": True},
    "half_workers": {"half_workers": True},
    "rehearse": {"rehearse": True},
    "eager_rehearse": {"env": {"CUDA_MODULE_LOADING": "EAGER"}, "rehearse": True},
    "eager_split": {"env": {"CUDA_MODULE_LOADING": "EAGER"}, "pattern": "split"},
    "eager_connections32": {"env": EmulatedWorld.ENVIRONMENT},
    "rehearse_rank_leaves": {"rehearse": True, "rank_leaves": True},
    "half_workers_rehearse": {"rehearse": True, "half_workers": True},
    "recommended": {"env": EmulatedWorld.ENVIRONMENT, "rehearse": True},
    "recommended_split": {"env": EmulatedWorld.ENVIRONMENT, "rehearse": True, "pattern": "split"},
    "recommended_half": {"env": EmulatedWorld.ENVIRONMENT, "rehearse": True, "half_workers": True},
    "fresh_grads": {"rehearse": True, "fresh_grads": True},
    "pre_gemm": {"rehearse": True, "extra": "pre_gemm"},
    "pre_gemm_eager": {"env": {"CUDA_MODULE_LOADING": "EAGER"}, "rehearse": True, "extra": "pre_gemm"},
    "pre_gemm_connections32": {"env": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, "rehearse": True, "extra": "pre_gemm"},
    "pre_exp": {"rehearse": True, "extra": "pre_exp"},
    "post_gemm": {"rehearse": True, "extra": "post_gemm"},
}
CASES = {
    "softmax": dict(hidden_size=1544, moe_intermediate_size=392, num_experts=48, top_k=8),
    "shared": dict(hidden_size=1544, moe_intermediate_size=392, num_experts=48, top_k=8, router="sigmoid_group",
                   n_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1),
    "softmax_shared": dict(hidden_size=1032, moe_intermediate_size=200, num_experts=48, top_k=6, num_shared_experts=2),
}
COUNTS = [517, 1, 300, 0, 129, 700, 64, 255]


def child(args: argparse.Namespace, variant: dict) -> dict:
    """One world, two calls of the chosen pattern; the outcome as a dict."""
    import torch

    from kosmos_moe import ExpertLayer
    from kosmos_moe.fabric import EmulatedWorld
    from kosmos_moe.fused import ExpertLayerTimeout, _PersistentLaunch

    launches: list[float] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            launches.append(float(record.getMessage().split()[0]))

    fused_log = logging.getLogger("kosmos_moe.fused")
    fused_log.setLevel(logging.DEBUG)
    fused_log.addHandler(Recorder())

    torch.manual_seed(0)
    shape, world = CASES[args.case], args.world
    full = ExpertLayer(**shape, dtype=torch.bfloat16, device="cuda")
    emulated = EmulatedWorld(world, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    workers = max(1, sms // world // 2) if variant.get("half_workers") else args.workers
    layers = []
    for r in range(world):
        layer = ExpertLayer(**shape, backend="kosmos", fabric=emulated.rank(r), max_tokens_per_rank=768,
                            workers_per_rank=workers, dtype=torch.bfloat16, device="cuda",
                            fused_options=dict(wait_bound=args.wait_bound))
        layer.load_full_state_dict(full.state_dict())
        layers.append(layer)
    for layer in layers:
        layer.fused().prepare(torch.bfloat16)
    outcome = {"finished": True, "record": "", "max_launch_gap_s": 0.0, "workers": layers[0].fused().workers}
    extra = variant.get("extra")
    if extra in ("pre_gemm", "post_gemm"):  # its kernels loaded beforehand: only their place in the queue is tested
        square = torch.randn(shape["hidden_size"], shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        for n in COUNTS[:world]:
            torch.randn(n, shape["hidden_size"], device="cuda", dtype=torch.bfloat16) @ square
        torch.cuda.synchronize()

    def forward(r, x):
        out = layers[r](x)
        if extra == "pre_gemm":
            out.register_hook(lambda g: g + 0.0 * (g @ square))
        elif extra == "pre_exp":
            out.register_hook(lambda g: g + 0.0 * g.exp())
        elif extra == "post_gemm":
            out = out + 0.0 * (out @ square)
        return out

    for call in range(2):
        counts = COUNTS[:world] if call % 2 == 0 else COUNTS[:world][::-1]
        xs = [torch.randn(n, shape["hidden_size"], device="cuda", dtype=torch.bfloat16) for n in counts]
        gs = [torch.randn_like(x) for x in xs]
        if variant.get("rehearse"):
            emulated.rehearse(full, xs, gs)
        if variant.get("fresh_grads"):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
        launches.clear()
        if variant.get("rank_leaves"):
            def fwd_bwd(r, x, g):
                x = x.clone().requires_grad_(True)
                torch.autograd.backward(forward(r, x), g)
            emulated.run(fwd_bwd, xs, gs)
        else:
            leaves = [x.clone().requires_grad_(True) for x in xs]
            if variant.get("pattern") == "split":
                outs = emulated.run(forward, leaves)
                emulated.run(lambda r, o, g: torch.autograd.backward(o, g), outs, gs)
            else:
                emulated.run(lambda r, x, g: torch.autograd.backward(forward(r, x), g), leaves, gs)
        gaps = [b - a for a, b in zip(launches, launches[1:])]
        outcome["max_launch_gap_s"] = max(outcome["max_launch_gap_s"], max(gaps, default=0.0))
        records = []  # every rank's first timeout: who waited for what tells the cycle apart
        for layer in layers:
            for launcher in (layer.fused(), layer.fused().backward):
                try:
                    _PersistentLaunch.raise_if_failed(launcher)  # this direction's record only
                except ExpertLayerTimeout as e:
                    records.append(str(e).split(". A peer")[0].replace("timed out after ", "after "))
        if records:
            outcome.update(finished=False, record=f"call {call}: " + " | ".join(records), state=world_state(layers))
            break
    return outcome


def world_state(layers) -> dict:
    """Per rank and direction after a stall: its epoch, the count-exchange flags it holds
    (one per source rank), its workspace address and the addresses it would write its peers at."""
    state = {}
    for r, layer in enumerate(layers):
        for launcher in (layer.fused(), layer.fused().backward):
            words, flag = launcher._words.cpu(), launcher.layout.words["flag"]
            world = launcher.fabric.world_size
            state[f"{launcher.direction} {r}"] = {
                "epoch": int(words[0]), "flags": words[flag: flag + world].tolist(),
                "local": hex(launcher.workspace.local.data_ptr()),
                "peers": [hex(p) for p in launcher.workspace.peers.cpu().tolist()],
            }
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--case", choices=sorted(CASES), default="softmax")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--wait-bound", type=int, default=1 << 24, help="polls before a kernel gives up")
    parser.add_argument("--workers", type=int, help="workers per rank (default: the library's; half_workers overrides)")
    parser.add_argument("--limit", type=float, default=90.0, help="seconds per variant, compile included")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Before any child runs: without a GPU every variant would be listed as failing, as if it stalled.
    require_cuda("world_liveness.py")
    if args.child:
        print("RESULT " + json.dumps(child(args, VARIANTS[args.child])), flush=True)
        return
    results = {}
    for name in args.variants:
        env = {**os.environ, **VARIANTS[name].get("env", {})}
        cmd = [sys.executable, __file__, "--child", name, "--world", str(args.world), "--case", args.case,
               "--wait-bound", str(args.wait_bound)] + (["--workers", str(args.workers)] if args.workers is not None else [])
        start = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {
                "finished": False, "record": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
        except subprocess.TimeoutExpired:
            result = {"finished": False, "record": f"no result within {args.limit:.0f} s (hang)"}
        result["seconds"] = round(time.time() - start, 1)
        results[name] = result
        print(f"{name:15s} {'ok  ' if result['finished'] else 'FAIL'} workers {result.get('workers')} gap {result.get('max_launch_gap_s', float('nan')):7.3f} s"
              f"  {result['seconds']:6.1f} s  {result['record']}", flush=True)
        for key, value in result.get("state", {}).items():
            print(f"    {key}: {value}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "case": args.case, "results": results}, f, indent=1)
    stalled = [name for name, result in results.items() if not result["finished"]]
    if stalled:  # a script or CI step running this sees the failure, not only the table
        print(f"{len(stalled)} of {len(results)} variants did not finish: {' '.join(stalled)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
