"""Expert parallelism over gloo in separate processes equals the one-rank layer."""

import pytest
import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from multiprocess import run_world

SHAPES = {
    "softmax": dict(hidden_size=24, moe_intermediate_size=20, num_experts=12, top_k=3, router="softmax"),
    "sigmoid_group": dict(
        hidden_size=28, moe_intermediate_size=12, num_experts=12, top_k=4, router="sigmoid_group",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1,
    ),
}


def tokens_of(rank: int, counts: list[int], hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(counts[rank], hidden, generator=g, dtype=torch.float64)


def check_equivalence(rank: int, world: int, case: str, counts: list[int], skew: bool) -> None:
    torch.manual_seed(0)
    shape = SHAPES[case]
    full = ExpertLayer(**shape, dtype=torch.float64)
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    if skew:  # every token chooses the last top_k experts (the last rank's, or the last two ranks')
        with torch.no_grad():
            full.gate.weight[-shape["top_k"]:] += 5.0
    ep = ExpertLayer(**shape, group=dist.group.WORLD, dtype=torch.float64)
    ep.load_full_state_dict(full.state_dict())
    assert ep.experts.gate_up_proj.shape[0] == shape["num_experts"] // world

    hidden = shape["hidden_size"]
    if skew:
        all_x = [tokens_of(r, counts, hidden).abs() for r in range(world)]
    else:
        all_x = [tokens_of(r, counts, hidden) for r in range(world)]
    g = torch.Generator().manual_seed(7)
    all_ct = [torch.randn(c, hidden, generator=g, dtype=torch.float64) for c in counts]

    x_full = torch.cat(all_x).requires_grad_(True)
    (full(x_full) * torch.cat(all_ct)).sum().backward()
    ref_out = full(x_full.detach())

    x = all_x[rank].clone().requires_grad_(True)
    out = ep(x)
    (out * all_ct[rank]).sum().backward()
    if skew:
        assert ep.tokens_per_expert[:-shape["top_k"]].sum() == 0, f"rank {rank}: the skew missed a choice"
        assert ep.tokens_per_expert[-shape["top_k"]:].tolist() == [counts[rank]] * shape["top_k"]

    # fp64 experts, fp32 routing weights: compare at fp32 precision. The router's fp32 logits
    # are sums in a different order on each side (a GEMM over other rows), so they may differ
    # by an ulp of their magnitude, and the routing weights move by as much relative: with the
    # skewed router's logits near 100 that is ~1e-5, well above an O(1) logit's rounding.
    logits = torch.cat(all_x) @ full.gate.weight.double().t()
    logit_scale = logits.abs().max().item() if logits.numel() else 0.0
    close = dict(rtol=1e-5, atol=1e-6 * max(1.0, logit_scale))
    start = sum(counts[:rank])
    torch.testing.assert_close(out, ref_out[start:start + counts[rank]], **close)
    torch.testing.assert_close(x.grad, x_full.grad[start:start + counts[rank]], **close)
    first, last = ep.local_expert_range
    for name, p in ep.named_parameters():
        grad = p.grad.clone()
        ref = dict(full.named_parameters())[name].grad
        if name.startswith("experts."):
            ref = ref[first:last]
        else:  # replicated parameters: each rank holds the gradient of its own tokens
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref, **close, msg=lambda m: f"rank {rank} {name}: {m}")

    if full.gate.e_score_correction_bias is not None:
        load = ep.update_router_bias()
        torch.testing.assert_close(load, full.load_since_bias_update // 2)  # full ran forward twice
        full.update_router_bias()
        torch.testing.assert_close(ep.gate.e_score_correction_bias, full.gate.e_score_correction_bias)


def check_indivisible_experts_rejected(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=f"num_experts=6 is not divisible by the expert-parallel world size {world}"):
        ExpertLayer(16, 8, 6, 2, group=dist.group.WORLD)


def run_cases(rank: int, world: int, cases: list) -> None:
    for args in cases:
        check_equivalence(rank, world, *args)
    if world == 4:
        check_indivisible_experts_rejected(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_rank(world):
    uneven = [11, 0, 5, 17][:world]  # rank 1 has no tokens at all
    run_world(
        world,
        run_cases,
        [
            ("softmax", [9] * world, False),
            ("sigmoid_group", uneven, False),
            ("softmax", uneven, True),
            ("sigmoid_group", [0] * world, False),  # an empty batch on every rank
        ],
    )
