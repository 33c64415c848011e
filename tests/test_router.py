"""Both routers on small cases whose answers are worked out by hand."""

import math

import pytest
import torch

from kosmos_moe.balance import switch_aux_loss, update_correction_bias
from kosmos_moe.router import route_sigmoid_group, route_softmax


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_softmax_top2_renormalised():
    r = route_softmax(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), top_k=2)
    assert r.experts.tolist() == [[2, 1]]
    # e^3 / (e^3 + e^2) = 1 / (1 + e^-1)
    expected = [1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]
    torch.testing.assert_close(r.weights, torch.tensor([expected]))
    assert r.weights.dtype == torch.float32


def test_softmax_without_renormalisation_keeps_probabilities():
    r = route_softmax(torch.tensor([[0.0, math.log(3.0)]]), top_k=1, norm_topk_prob=False)
    assert r.experts.tolist() == [[1]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.75]]))


def test_softmax_routes_in_fp32_for_bf16_logits():
    r = route_softmax(torch.tensor([[0.5, 0.25, -1.0]], dtype=torch.bfloat16), top_k=2)
    assert r.weights.dtype == torch.float32 and r.scores.dtype == torch.float32


@pytest.mark.parametrize("router", ["softmax", "sigmoid_group"])
def test_router_stays_fp32_under_autocast(router):
    """torch.autocast would run the gate's linear in bf16: the logits, choices and weights
    must be those of the fp32 router, as the fused kernel computes them."""
    from kosmos_moe import ExpertLayer

    torch.manual_seed(0)
    groups = dict(n_group=4, topk_group=2) if router == "sigmoid_group" else {}
    gate = ExpertLayer(64, 16, 16, 4, router=router, **groups, dtype=torch.bfloat16).gate
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    plain = gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = gate.logits(x)
        cast = gate(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, gate.logits(x), rtol=0, atol=0)
    assert torch.equal(cast.experts, plain.experts)
    torch.testing.assert_close(cast.weights, plain.weights, rtol=0, atol=0)


# Sigmoid scores per expert, four groups of two experts:
#   group 0: 0.90 0.10 (top-2 sum 1.00)   group 1: 0.60 0.55 (1.15)
#   group 2: 0.95 0.01 (0.96)             group 3: 0.20 0.20 (0.40)
# topk_group=2 keeps groups 1 and 0, so expert 4 (0.95, the best single score) is excluded.
SCORES = [0.90, 0.10, 0.60, 0.55, 0.95, 0.01, 0.20, 0.20]
LOGITS = torch.tensor([[logit(p) for p in SCORES]], dtype=torch.float64)


def test_sigmoid_group_limits_choice_to_best_groups():
    r = route_sigmoid_group(LOGITS, None, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert r.experts.tolist() == [[0, 2, 3]]
    total = 0.90 + 0.60 + 0.55
    torch.testing.assert_close(
        r.weights, torch.tensor([[0.90 / total * 2.5, 0.60 / total * 2.5, 0.55 / total * 2.5]]), atol=1e-6, rtol=1e-6
    )


def test_sigmoid_group_bias_moves_choice_but_not_weights():
    # +0.5 on expert 3 makes it the first choice (1.05) and lifts group 1 (0.60 + 1.05);
    # -0.5 on expert 0 drops group 0 (0.40 + 0.10 = 0.50) below group 2 (0.96).
    bias = torch.tensor([-0.5, 0, 0, 0.5, 0, 0, 0, 0])
    r = route_sigmoid_group(LOGITS, bias, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    assert r.experts.tolist() == [[3, 4, 2]]
    total = 0.55 + 0.95 + 0.60
    torch.testing.assert_close(r.weights, torch.tensor([[0.55 / total, 0.95 / total, 0.60 / total]]), atol=1e-6, rtol=1e-6)


def test_sigmoid_group_masked_experts_never_chosen_even_if_negative_choice_scores():
    # A large negative bias makes every kept-group choice score negative; a zero mask (instead
    # of -inf) would then pick a masked expert.
    bias = torch.full((8,), -2.0)
    r = route_sigmoid_group(LOGITS, bias, top_k=4, n_group=4, topk_group=2)
    assert sorted(r.experts.tolist()[0]) == [0, 1, 2, 3]


def test_sigmoid_without_renormalisation():
    r = route_sigmoid_group(LOGITS, None, top_k=2, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0)
    assert r.experts.tolist() == [[4, 0]]
    torch.testing.assert_close(r.weights, torch.tensor([[1.90, 1.80]]), atol=1e-6, rtol=1e-6)


def test_router_gradient_flows_through_weights_only():
    logits = LOGITS.clone().float().requires_grad_(True)
    r = route_sigmoid_group(logits, torch.zeros(8), top_k=3, n_group=4, topk_group=2)
    r.weights[0, 0].backward()
    # d(w0)/d(logit_e) is non-zero only for the chosen experts.
    nonzero = (logits.grad[0] != 0).nonzero().flatten().tolist()
    assert nonzero == [0, 2, 3]


def test_bias_update_rule():
    bias = torch.zeros(4)
    update_correction_bias(bias, torch.tensor([1, 2, 3, 6]))  # mean 3
    torch.testing.assert_close(bias, torch.tensor([1e-3, 1e-3, 0.0, -1e-3]))
    update_correction_bias(bias, torch.tensor([1, 2, 3, 6]), rate=0.5)
    torch.testing.assert_close(bias, torch.tensor([0.501, 0.501, 0.0, -0.501]))


def test_switch_aux_loss_hand_case():
    # Two tokens, two experts, top-1: both go to expert 0 with probabilities 0.75 / 0.25.
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    experts = torch.tensor([[0], [0]])
    # E * sum f_i P_i = 2 * (1.0 * 0.75 + 0.0 * 0.25)
    torch.testing.assert_close(switch_aux_loss(scores, experts, 2), torch.tensor(1.5))
    balanced = switch_aux_loss(torch.full((2, 2), 0.5), torch.tensor([[0], [1]]), 2)
    torch.testing.assert_close(balanced, torch.tensor(1.0))


@pytest.mark.parametrize("router", ["softmax", "sigmoid_group"])
def test_empty_batch_routes(router):
    logits = torch.zeros(0, 8)
    if router == "softmax":
        r = route_softmax(logits, top_k=2)
    else:
        r = route_sigmoid_group(logits, torch.zeros(8), top_k=2, n_group=4, topk_group=2)
    assert r.experts.shape == (0, 2) and r.weights.shape == (0, 2)
