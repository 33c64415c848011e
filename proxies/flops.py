"""Model FLOPs of a training step, for MFU.

Per token: ``6 * active parameters`` (forward 2, backward 4 FLOPs per multiply-accumulate) plus
the attention score and value matmuls, which have no parameters: ``3 (fwd+bwd) * 2 * S * heads
* (d_qk + d_v) / 2`` per layer, halved because a causal mask leaves half the square (the
FlashAttention convention; torchtitan counts the full square, 2x this term).

Active parameters are those a token multiplies by: every matrix except the embedding table
(a lookup), with the routed experts of each MoE layer counted as ``top_k`` experts of the
layer's ``num_experts`` (the router and shared experts fully). The LM head counts. Counted from
the layer configs, so an expert-parallel rank, which holds only its experts, gets the same number.
"""

from __future__ import annotations

from .common import ProxyModel


def active_params(model: ProxyModel) -> int:
    routed = 0
    for layer in model.moe_layers():
        c = layer.config
        routed_local = layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()
        routed += routed_local - c.top_k * 3 * c.hidden_size * c.moe_intermediate_size
    local = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    return local - routed


def total_params(model: ProxyModel) -> int:
    """Parameters of the whole model (all experts, not only this rank's)."""
    n = sum(p.numel() for p in model.parameters())
    for layer in model.moe_layers():
        c = layer.config
        n += (c.num_experts - layer.num_local_experts) * 3 * c.hidden_size * c.moe_intermediate_size
    return n


def flops_per_token(model: ProxyModel, seq_len: int) -> float:
    return 6.0 * active_params(model) + model.config.attention_flops_per_token(seq_len)

