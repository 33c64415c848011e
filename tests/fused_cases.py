"""The fused-layer cases of the CPU tests (interpreter, fp32), and the routing skews every
fused test (CPU, GPU, torchrun) applies the same way."""

from dataclasses import replace

import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from kosmos_moe.workspace import INTERPRETER_TILES


def skew_router(full: ExpertLayer, skew: str, world: int) -> None:
    """Skew ``full``'s router for tokens whose first feature is positive and large
    (:func:`skew_tokens`): ``one_expert``, every token's first choice is the last expert;
    ``one_rank``, every choice lands on the last rank's experts (as many as they allow)."""
    with torch.no_grad():
        if skew == "one_expert":
            full.gate.weight[-1] = 0.0
            full.gate.weight[-1, 0] = 10.0
            bias = full.gate.e_score_correction_bias
            if bias is not None:
                # Group-limited routing picks groups by their best biased scores first: other
                # experts' sigmoids near one could outrank this expert's group without it.
                bias[-1] = 2.0
        elif skew == "one_rank":
            full.gate.weight[-(full.config.num_experts // world):, 0] += 10.0
        elif skew != "none":
            raise ValueError(f"unknown skew {skew!r}")


def assert_skew_took(layer: ExpertLayer, skew: str, world: int, n: int, what: str = "") -> None:
    """After a call of ``n`` skewed tokens, the layer's routing counts show the skew of
    :func:`skew_router` took: the last expert in every token's choices, or no choice off the
    last rank's experts."""
    if skew == "one_expert" and n:
        assert layer.tokens_per_expert[-1] == n, f"{what}: a token's choices missed the skewed expert"
    if skew == "one_rank":
        local = layer.config.num_experts // world
        assert layer.tokens_per_expert[:-local].sum() == 0, f"{what}: a choice left the last rank"


def skew_tokens(x: torch.Tensor) -> torch.Tensor:
    """Make every token's first feature positive and at least 1, in place (see :func:`skew_router`)."""
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


# Non-power-of-two hidden and intermediate sizes throughout; token counts that are mostly no
# multiple of any tile (16 in the interpreter's tiles; 16 itself once, a full last tile) and a
# rank with no tokens.
CASES = {
    "softmax": dict(
        shape=dict(hidden_size=24, moe_intermediate_size=20, num_experts=8, top_k=3),
        # The default tiles: routed gate/up tiles as one dot of both blocks, weights by TMA
        # through a [2E, I, H] descriptor (I = 20 leaves a half-empty second column block).
        counts=[37, 5, 0, 19], workers=1,
    ),
    "softmax_shared": dict(
        shape=dict(hidden_size=40, moe_intermediate_size=12, num_experts=8, top_k=2, num_shared_experts=2),
        counts=[18, 33, 7, 1], workers=3,
        # Gate and up blocks as two dots; each tile's expert entries in one reduction; gate/up
        # tickets claimed a tile ahead, as down tickets are, not in the pass that reaches them.
        tiles=replace(INTERPRETER_TILES, gate_up_one_dot=False, merged_lookup_from=1, gate_up_claim_ahead=True),
    ),
    "sigmoid_group_shared": dict(
        shape=dict(hidden_size=28, moe_intermediate_size=12, num_experts=16, top_k=4, router="sigmoid_group",
                   n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1),
        counts=[21, 0, 40, 3], workers=1,
    ),
    "sigmoid_group": dict(
        shape=dict(hidden_size=20, moe_intermediate_size=36, num_experts=8, top_k=3, router="sigmoid_group",
                   n_group=2, topk_group=1, routed_scaling_factor=1.5),
        counts=[16, 9, 30, 2], workers=2,
        # The pointer-load weight tiles (GPUs before Hopper, rows of no multiple of 16 bytes),
        # two dots per gate/up step; softmax_rows32 has them with one dot. The other cases read
        # weights by TMA, as on the H200. Dispatch chunks held from the route phase run at
        # their holder's next idle pass, the order before Tiles.held_chunk_first.
        tiles=replace(INTERPRETER_TILES, tma=False, gate_up_one_dot=False, held_chunk_first=False),
    ),
    # Experts of a few rows up to a few 32-row tiles: full, partial and single-row last tiles;
    # one-dot gate/up tiles by pointer loads.
    "softmax_rows32": dict(
        shape=dict(hidden_size=24, moe_intermediate_size=20, num_experts=8, top_k=3),
        counts=[75, 9, 0, 30], workers=2,
        tiles=replace(INTERPRETER_TILES, rows=32, tma=False),
    ),
}


# Edge shapes, world 1 (tests/test_fused_backward_cpu.py::test_edge_shapes): one expert; every
# expert chosen; sizes of 1, 3, 5, 7 and around a 16-wide tile; one expert per routing group
# with three shared experts; more workers than tiles; 40 experts, which the route backward's
# d logits @ Wr takes in 16-expert steps (the interpreter's route_depth), the last one past E.
# (A top-1 choice with normalised weights has a router gradient of exactly zero, which the
# kernel returns and the reference misses by rounding noise: the relative tolerances cannot
# judge it, so no case here has one.)
EDGE_CASES = {
    "one_expert": dict(shape=dict(hidden_size=7, moe_intermediate_size=5, num_experts=1, top_k=1),
                       counts=[13], workers=1),
    "every_expert": dict(shape=dict(hidden_size=17, moe_intermediate_size=15, num_experts=4, top_k=4,
                                    norm_topk_prob=False), counts=[9], workers=9),
    "group_per_expert": dict(
        shape=dict(hidden_size=5, moe_intermediate_size=3, num_experts=8, top_k=3, router="sigmoid_group",
                   n_group=8, topk_group=8, routed_scaling_factor=2.5, num_shared_experts=3),
        counts=[1], workers=2),
    "width_one": dict(shape=dict(hidden_size=1, moe_intermediate_size=33, num_experts=3, top_k=2,
                                 num_shared_experts=1), counts=[16], workers=3),
    "forty_experts": dict(
        shape=dict(hidden_size=20, moe_intermediate_size=12, num_experts=40, top_k=4, router="sigmoid_group",
                   n_group=4, topk_group=2, routed_scaling_factor=2.5),
        counts=[21], workers=2),
}
ALL_CASES = {**CASES, **EDGE_CASES}


def build(world, case, skew, max_tokens, dtype=None, **fused_options):
    """The full reference layer (seeded, skewed, fp32) and this rank's fused layer loaded from
    it (in ``dtype``, fp32 by default)."""
    spec = ALL_CASES[case]
    shape = spec["shape"]
    torch.manual_seed(0)
    full = ExpertLayer(**shape)
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    skew_router(full, skew, world)
    group = dist.group.WORLD if world > 1 else None
    fused = ExpertLayer(**shape, backend="kosmos", group=group, max_tokens_per_rank=max_tokens,
                        workers_per_rank=spec["workers"], fused_options=dict(tiles=spec.get("tiles"), **fused_options),
                        dtype=dtype)
    fused.load_full_state_dict(full.state_dict())
    return full, fused


def tokens(counts, hidden, seed, positive):
    """Every rank's tokens, seeded by rank: every process builds the same list."""
    out = []
    for r, n in enumerate(counts):
        x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed * 100 + r))
        out.append(skew_tokens(x) if positive else x)
    return out


# The GPU tests' shapes (bf16): hidden and intermediate sizes that are no power of two; 48
# experts divide over 1, 2, 3, 4 and 8 ranks.
GPU_SHAPES = {
    "softmax": dict(hidden_size=1544, moe_intermediate_size=392, num_experts=48, top_k=8),
    "sigmoid_group_shared": dict(
        hidden_size=1544, moe_intermediate_size=392, num_experts=48, top_k=8, router="sigmoid_group",
        n_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1,
    ),
    "softmax_shared": dict(hidden_size=1032, moe_intermediate_size=200, num_experts=48, top_k=6, num_shared_experts=2),
    "sigmoid_group": dict(
        hidden_size=1032, moe_intermediate_size=200, num_experts=48, top_k=8, router="sigmoid_group",
        n_group=4, topk_group=2, routed_scaling_factor=1.0,
    ),
    # DeepSeek-V3's routing (8 of 64 experts in 4 of 8 groups, scaled sigmoid weights, one shared
    # expert) and its experts-per-rank at 8 ranks, at a hidden size of 1024 + 8.
    "deepseek_v3_like": dict(
        hidden_size=1032, moe_intermediate_size=264, num_experts=64, top_k=8, router="sigmoid_group",
        n_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1,
    ),
}
# Tokens per rank: uneven, no multiple of any tile, rank 3 without tokens, rank 1 with one.
GPU_COUNTS = [517, 1, 300, 0, 129, 700, 64, 255]


def gpu_full_layer(case: str, world: int, skew: str = "none") -> ExpertLayer:
    """The bf16 reference layer of a GPU case (seeded, skewed); every rank's experts come from it."""
    torch.manual_seed(0)
    full = ExpertLayer(**GPU_SHAPES[case], dtype=torch.bfloat16, device="cuda")
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    skew_router(full, skew, world)
    return full


def fp32_truth(full: ExpertLayer, case: str) -> ExpertLayer:
    """An fp32 layer with ``full``'s bf16 weights: what both bf16 paths are judged against."""
    truth = ExpertLayer(**GPU_SHAPES[case], dtype=torch.float32, device="cuda")
    truth.load_state_dict({k: v.float() for k, v in full.state_dict().items()})
    return truth


def emulated_gpu_world(case: str, world: int, skew: str = "none", workers: int | None = None,
                       max_tokens: int = 768, wait_bound: int | None = None, tiles=None, backward_tiles=None):
    """``(full, emulated, layers)``: the reference layer and one fused layer per rank of an
    emulated world on the current GPU, their workspaces built (a sync) before any run;
    ``tiles``, ``backward_tiles``: the forward's and the backward's (default: the GPU's)."""
    from kosmos_moe.fabric import EmulatedWorld

    full = gpu_full_layer(case, world, skew)
    emulated = EmulatedWorld(world, "cuda")
    layers = []
    for r in range(world):
        layer = ExpertLayer(**GPU_SHAPES[case], backend="kosmos", fabric=emulated.rank(r), max_tokens_per_rank=max_tokens,
                            workers_per_rank=workers, dtype=torch.bfloat16, device="cuda",
                            fused_options=dict(wait_bound=wait_bound, tiles=tiles, backward_tiles=backward_tiles))
        layer.load_full_state_dict(full.state_dict())
        layers.append(layer)
    for layer in layers:
        layer.fused().prepare(torch.bfloat16)
    return full, emulated, layers
