"""Token-choice routers: softmax top-k (Qwen3) and group-limited sigmoid top-k (DeepSeek-V3).

All routing math is fp32 whatever the activation dtype, as in the reference models: the
choice of experts is sensitive to rounding and the router GEMM is small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


@dataclass
class Routing:
    """The routing decision for a batch of tokens.

    ``weights`` and ``experts`` are ``[tokens, top_k]``; row t holds the chosen global expert ids
    of token t (in descending order of choice score) and their fp32 combine weights. ``scores``
    is the ``[tokens, num_experts]`` fp32 probability that the auxiliary loss uses: softmax
    probabilities or sigmoid scores (without the correction bias).
    """

    weights: torch.Tensor
    experts: torch.Tensor
    scores: torch.Tensor


def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> Routing:
    """Softmax over all experts, keep the top-k, optionally renormalise them to sum to one."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(scores, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights=weights, experts=experts, scores=scores)


def route_sigmoid_group(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> Routing:
    """DeepSeek-V3 routing: sigmoid scores, bias-corrected group-limited choice, unbiased weights.

    The correction bias moves the choice only. A group's score is the sum of its best two
    bias-corrected scores; experts outside the best ``topk_group`` groups are masked with -inf
    before the top-k.
    """
    tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    # The choice path carries no gradient: only the gathered unbiased scores do.
    choice = choice.detach()
    if n_group > 1:
        grouped = choice.view(tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept_groups = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return Routing(weights=weights, experts=experts, scores=scores)


class Router(nn.Module):
    """The gate of an expert layer: an fp32 linear scorer plus the configured top-k rule.

    Parameters follow the Hugging Face layout: ``weight`` is ``[num_experts, hidden]`` and, for
    ``sigmoid_group`` routing, the buffer ``e_score_correction_bias`` is ``[num_experts]``.
    """

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype, device=device))
        if config.router == "sigmoid_group":
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.e_score_correction_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.config.hidden_size**-0.5)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        # fp32 under torch.autocast too (it would run this linear in bf16/fp16 and change the
        # choices), as the fused kernel's router computes.
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.float(), self.weight.float())

    def forward(self, tokens: torch.Tensor) -> Routing:
        c = self.config
        logits = self.logits(tokens)
        if c.router == "softmax":
            return route_softmax(logits, c.top_k, c.norm_topk_prob)
        return route_sigmoid_group(
            logits,
            self.e_score_correction_bias,
            c.top_k,
            c.n_group,
            c.topk_group,
            c.routed_scaling_factor,
            c.norm_topk_prob,
        )
