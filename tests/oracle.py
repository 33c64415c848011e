"""An independent per-token MoE oracle for the tests: plain Python choice, per-token matmuls.

Written apart from ``kosmos_moe`` on purpose: it shares no code with the library, so the
library cannot agree with it by construction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def choose_experts(logits: list[float], cfg: dict, bias: list[float] | None) -> tuple[list[int], list[float]]:
    """Return (experts, unscaled-or-scaled weights) of one token, as plain Python."""
    num_experts, top_k = len(logits), cfg["top_k"]
    if cfg["router"] == "softmax":
        peak = max(logits)
        exps = [math.exp(v - peak) for v in logits]
        probs = [v / sum(exps) for v in exps]
        chosen = sorted(range(num_experts), key=lambda e: -probs[e])[:top_k]
        weights = [probs[e] for e in chosen]
        if cfg["norm_topk_prob"]:
            weights = [w / sum(weights) for w in weights]
        return chosen, weights
    scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(scores)]
    n_group, size = cfg["n_group"], num_experts // cfg["n_group"]
    group_score = []
    for g in range(n_group):
        members = sorted(choice[g * size:(g + 1) * size], reverse=True)
        group_score.append(sum(members[:2]))
    kept = sorted(range(n_group), key=lambda g: -group_score[g])[: cfg["topk_group"]]
    candidates = [e for e in range(num_experts) if e // size in kept]
    chosen = sorted(candidates, key=lambda e: -choice[e])[:top_k]
    weights = [scores[e] for e in chosen]
    if cfg["norm_topk_prob"]:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * cfg["routed_scaling_factor"] for w in weights]


def oracle_forward(x: torch.Tensor, params: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """Differentiable per-token forward of the whole layer. ``params`` uses the HF names."""
    gate_w = params["gate.weight"]
    bias = params.get("gate.e_score_correction_bias")
    bias_list = bias.tolist() if bias is not None else None
    gate_up, down = params["experts.gate_up_proj"], params["experts.down_proj"]
    inter = down.shape[-1]
    outputs = []
    for t in range(x.shape[0]):
        token = x[t]
        logits = gate_w.double() @ token.double()
        chosen, _ = choose_experts(logits.tolist(), cfg, bias_list)
        # Recompute the weights with torch ops so that gradients reach the router weight.
        if cfg["router"] == "softmax":
            probs = torch.softmax(logits, dim=0)[chosen]
            weights = probs / probs.sum() if cfg["norm_topk_prob"] else probs
        else:
            scores = torch.sigmoid(logits)[chosen]
            weights = scores / scores.sum() if cfg["norm_topk_prob"] else scores
            weights = weights * cfg["routed_scaling_factor"]
        y = torch.zeros_like(token, dtype=torch.float64)
        for w, e in zip(weights, chosen):
            gate = gate_up[e, :inter] @ token
            up = gate_up[e, inter:] @ token
            y = y + w * (down[e] @ (F.silu(gate) * up)).double()
        if "shared_experts.gate_proj.weight" in params:
            g = params["shared_experts.gate_proj.weight"] @ token
            u = params["shared_experts.up_proj.weight"] @ token
            y = y + (params["shared_experts.down_proj.weight"] @ (F.silu(g) * u)).double()
        outputs.append(y.to(x.dtype))
    if not outputs:
        return x.new_zeros(0, x.shape[-1])
    return torch.stack(outputs)
