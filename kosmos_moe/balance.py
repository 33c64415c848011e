"""Load balancing: the aux-loss-free correction-bias update, the switch auxiliary loss, load counts."""

from __future__ import annotations

import torch

BIAS_UPDATE_RATE = 1e-3


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, k) assignments each expert received: int64 ``[num_experts]``.

    A scatter-add, not ``torch.bincount``: bincount on CUDA reads the maximum on the host,
    a sync that would stall a fused forward whose peers have not launched yet.
    """
    flat = experts.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


@torch.no_grad()
def update_correction_bias(
    bias: torch.Tensor, load: torch.Tensor, rate: float = BIAS_UPDATE_RATE
) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing step, in place: ``bias += rate * sign(mean - load)``.

    Under-loaded experts gain score for the choice and over-loaded ones lose it; experts at
    exactly the mean load are left alone.
    """
    load = load.to(torch.float32)
    bias.add_(rate * torch.sign(load.mean() - load))
    return bias


def switch_aux_loss(scores: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of (token, k) assignments sent to expert i (no gradient) and ``P_i``
    the mean routing probability of expert i. Sigmoid scores are first normalised per token so
    that ``P`` is a distribution for either router. Equals 1 under perfect balance.
    """
    if experts.numel() == 0:
        return scores.sum() * 0.0
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    fraction = tokens_per_expert(experts, num_experts).to(probs.dtype) / experts.numel()
    return num_experts * torch.dot(fraction, probs.mean(dim=0))
