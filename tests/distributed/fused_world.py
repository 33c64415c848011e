"""The fused forward and backward across real GPUs: run under torchrun, one process per GPU.

    torchrun --standalone --nproc-per-node 8 tests/distributed/fused_world.py

Every rank builds the same full layer (same seed), keeps its experts, and feeds its own
tokens (uneven counts, one rank empty when the world has more than two ranks). Outputs and
gradients are compared with an fp32 evaluation of the same bf16 weights on the concatenation
of all ranks' tokens (the replicated shared-expert weights: on each rank's own tokens; the
expert weights per expert); the fused error must stay within twice the bf16 reference
backend's (tests/accuracy.py).
The last check has rank 1 skip a call: rank 0 must raise ExpertLayerTimeout naming rank 1.
With one process, the symmetric-memory fabric is used explicitly (a world of 1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from kosmos_moe.fabric import SymmetricMemoryFabric
from kosmos_moe.fused import ExpertLayerTimeout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GPU cases and their accuracy rule
from accuracy import FLOOR, accuracy_problem  # noqa: E402
from fused_cases import GPU_COUNTS, GPU_SHAPES, fp32_truth, gpu_full_layer, skew_tokens  # noqa: E402

CASES = ("sigmoid_group_shared", "softmax")


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def build(case: str, skew: str, world: int):
    full = gpu_full_layer(case, world, skew)
    kw = dict(fabric=SymmetricMemoryFabric(dist.group.WORLD)) if world == 1 else dict(group=dist.group.WORLD)
    fused = ExpertLayer(**GPU_SHAPES[case], backend="kosmos", max_tokens_per_rank=768, dtype=torch.bfloat16,
                        device="cuda", **kw)
    fused.load_full_state_dict(full.state_dict())
    return full, fused


def reference(layer: ExpertLayer, xs: list, gs: list, dtype: torch.dtype) -> tuple:
    """Output, x grad and parameter grads of ``layer`` on every rank's tokens in ``xs``."""
    layer.zero_grad(set_to_none=True)
    x = torch.cat(xs).to(dtype).requires_grad_()
    out = layer(x)
    torch.autograd.backward(out, torch.cat(gs).to(dtype))
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).float()
             for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach().float(), x.grad.float(), grads


def check(case: str, skew: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    full, fused = build(case, skew, world)
    hidden = GPU_SHAPES[case]["hidden_size"]
    counts = [GPU_COUNTS[r % len(GPU_COUNTS)] for r in range(world)]
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16) for n in counts]
    gs = [torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16) for n in counts]
    if skew != "none":
        xs = [skew_tokens(x) for x in xs]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    x = xs[rank].clone().requires_grad_()
    out = fused(x)
    torch.autograd.backward(out, gs[rank])
    fused.fused().raise_if_failed()

    truth = fp32_truth(full, case)
    ref_out, ref_x, ref = reference(full, xs, gs, torch.bfloat16)
    tru_out, tru_x, tru = reference(truth, xs, gs, torch.float32)
    # The replicated weights' .grad on a rank covers its own tokens only.
    _, _, ref_own = reference(full, [xs[rank]], [gs[rank]], torch.bfloat16)
    _, _, tru_own = reference(truth, [xs[rank]], [gs[rank]], torch.float32)

    first, last = fused.local_expert_range
    params = dict(fused.named_parameters())
    router_sum = fused.gate.weight.grad.float().clone()
    dist.all_reduce(router_sum)
    checks = [
        ("out", out, ref_out[mine], tru_out[mine], False),  # one bf16 rounding: floor 1e-3 below
        ("grad_x", x.grad, ref_x[mine], tru_x[mine], False),
        ("grad_router summed over the ranks", router_sum, ref["gate.weight"], tru["gate.weight"], False),
    ]
    for name in ("experts.gate_up_proj", "experts.down_proj"):  # per expert: a starved one on its own scale
        checks.append((name, params[name].grad, ref[name][first:last], tru[name][first:last], True))
    for name in params:
        if name.startswith("shared_experts."):
            checks.append((f"{name} (own tokens)", params[name].grad, ref_own[name], tru_own[name], False))
    problems = [p for what, got, r, t, per_expert in checks
                if (p := accuracy_problem(got, r, t, f"rank {rank} {case}/{skew} {what}", per_expert,
                                          floor=1e-3 if what == "out" else FLOOR)) is not None]
    for problem in problems:
        print(f"FAIL {problem}", flush=True)
    status = torch.tensor([len(problems)], device="cuda")
    dist.all_reduce(status)
    if status.item():
        raise SystemExit(1)
    log(f"ok {case}/{skew} world {world}")


def check_timeout() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return
    layer = ExpertLayer(64, 32, 8, 2, backend="kosmos", group=dist.group.WORLD, max_tokens_per_rank=16,
                        dtype=torch.bfloat16, device="cuda", fused_options=dict(wait_bound=1 << 20))
    # One call on every rank first: the first call's warm-up ends in a barrier, which a rank
    # that never calls would leave the others waiting in (a collective without a bound).
    with torch.no_grad():
        layer(torch.randn(5, 64, device="cuda", dtype=torch.bfloat16))
    layer.fused().raise_if_failed()
    if rank != 1:
        with torch.no_grad():
            layer(torch.randn(5, 64, device="cuda", dtype=torch.bfloat16))
        try:
            layer.fused().raise_if_failed()
        except ExpertLayerTimeout as e:
            assert "count-exchange signal of rank 1" in str(e), str(e)
            log(f"ok timeout: {e}")
        else:
            raise AssertionError(f"rank {rank} did not time out although rank 1 never called")
    dist.barrier()


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        for case in CASES:
            check(case, "none")
        if dist.get_world_size() > 1:  # with one rank every expert is the last rank's: nothing to skew
            check("sigmoid_group_shared", "one_rank")
        check_timeout()
        log("all passed")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
