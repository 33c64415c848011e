"""The fused forward and backward across real GPUs: run under torchrun, one process per GPU.

    torchrun --standalone --nproc-per-node 8 tests/distributed/fused_world.py

Every rank builds the same full layer (same seed), keeps its experts, and feeds its own
tokens (uneven counts, one rank empty when the world has more than two ranks). Outputs and
gradients are compared with an fp32 evaluation of the same bf16 weights on the concatenation
of all ranks' tokens; the fused error must stay within twice the bf16 reference backend's.
The last check has rank 1 skip a call: rank 0 must raise ExpertLayerTimeout naming rank 1.
With one process, the symmetric-memory fabric is used explicitly (a world of 1).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from kosmos_moe.fabric import SymmetricMemoryFabric
from kosmos_moe.fused import ExpertLayerTimeout

SHAPES = {
    "sigmoid_group_shared": dict(hidden_size=1032, moe_intermediate_size=200, num_experts=48, top_k=8,
                                 router="sigmoid_group", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                 num_shared_experts=1),
    "softmax": dict(hidden_size=1544, moe_intermediate_size=392, num_experts=48, top_k=8),
}
COUNTS = [517, 1, 300, 0, 129, 700, 64, 255]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def build(case: str, skew: str, world: int, rank: int):
    torch.manual_seed(0)
    shape = SHAPES[case]
    full = ExpertLayer(**shape, dtype=torch.bfloat16, device="cuda")
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    if skew == "one_rank":
        with torch.no_grad():
            full.gate.weight[-shape["num_experts"] // world:, 0] += 10.0
    kw = dict(fabric=SymmetricMemoryFabric(dist.group.WORLD)) if world == 1 else dict(group=dist.group.WORLD)
    fused = ExpertLayer(**shape, backend="kosmos", max_tokens_per_rank=768, dtype=torch.bfloat16, device="cuda", **kw)
    fused.load_full_state_dict(full.state_dict())
    return full, fused


def check(case: str, skew: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    full, fused = build(case, skew, world, rank)
    hidden = SHAPES[case]["hidden_size"]
    counts = [COUNTS[r % len(COUNTS)] for r in range(world)]
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16) for n in counts]
    gs = [torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16) for n in counts]
    if skew != "none":
        for x in xs:
            x[:, 0] = x[:, 0].abs() + 1.0
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    x = xs[rank].clone().requires_grad_()
    out = fused(x)
    torch.autograd.backward(out, gs[rank])
    fused.fused().raise_if_failed()

    truth = ExpertLayer(**SHAPES[case], dtype=torch.float32, device="cuda")
    truth.load_state_dict({k: v.float() for k, v in full.state_dict().items()})
    x_all = torch.cat(xs)
    xt = x_all.float().requires_grad_()
    torch.autograd.backward(truth(xt), torch.cat(gs).float())
    xr = x_all.clone().requires_grad_()
    ref = full(xr)
    torch.autograd.backward(ref, torch.cat(gs))

    first, last = fused.local_expert_range
    router_sum = fused.gate.weight.grad.float().clone()
    dist.all_reduce(router_sum)  # each rank's router gradient covers its own tokens
    pairs = {
        "out": (out, ref[mine], truth(x_all.float())[mine].detach()),
        "grad_x": (x.grad, xr.grad[mine], xt.grad[mine]),
        "grad_gate_up": (fused.experts.gate_up_proj.grad, full.experts.gate_up_proj.grad[first:last],
                         truth.experts.gate_up_proj.grad[first:last]),
        "grad_down": (fused.experts.down_proj.grad, full.experts.down_proj.grad[first:last],
                      truth.experts.down_proj.grad[first:last]),
        "grad_router": (router_sum, full.gate.weight.grad, truth.gate.weight.grad),
    }
    for name, (got, ref_v, true_v) in pairs.items():
        if true_v.numel() == 0:
            continue
        err_fused = (got.float() - true_v.float()).abs().max().item()
        err_ref = (ref_v.float() - true_v.float()).abs().max().item()
        scale = true_v.abs().max().item()
        ok = err_fused <= max(2 * err_ref, 2e-3 * scale)
        status = torch.tensor([0 if ok else 1], device="cuda")
        dist.all_reduce(status)
        if not ok:
            print(f"FAIL rank {rank} {case}/{skew} {name}: fused {err_fused:.3g}, reference {err_ref:.3g}, "
                  f"scale {scale:.3g}", flush=True)
        if status.item():
            raise SystemExit(1)
    log(f"ok {case}/{skew} world {world}")


def check_timeout() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return
    layer = ExpertLayer(64, 32, 8, 2, backend="kosmos", group=dist.group.WORLD, max_tokens_per_rank=16,
                        dtype=torch.bfloat16, device="cuda", fused_options=dict(wait_bound=1 << 20))
    layer.fused().prepare(torch.bfloat16)
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
        for case in SHAPES:
            check(case, "none")
        check("sigmoid_group_shared", "one_rank")
        check_timeout()
        log("all passed")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
