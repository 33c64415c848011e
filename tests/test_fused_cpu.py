"""The fused forward kernel under Triton's interpreter, in emulated worlds of CPU processes.

Each rank is its own process (the interpreter runs a grid's programs one after another) and
peers share workspaces through /dev/shm. Every case is compared with the reference backend
of one rank holding all experts, on the concatenation of every rank's tokens.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from kosmos_moe.workspace import INTERPRETER_TILES, BackwardTiles
from multiprocess import run_world

INTERPRET = {"TRITON_INTERPRET": "1"}

# Non-power-of-two hidden and intermediate sizes throughout; token counts that are no
# multiple of any tile (16 in the interpreter's tiles) and a rank with no tokens.
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
        tiles=replace(INTERPRETER_TILES, gate_up_one_dot=False),  # gate and up blocks as two dots
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
        # weights by TMA, as on the H200.
        tiles=replace(INTERPRETER_TILES, tma=False, gate_up_one_dot=False),
    ),
    # Experts of a few rows up to a few 32-row tiles: full, partial and single-row last tiles;
    # one-dot gate/up tiles by pointer loads.
    "softmax_rows32": dict(
        shape=dict(hidden_size=24, moe_intermediate_size=20, num_experts=8, top_k=3),
        counts=[75, 9, 0, 30], workers=2,
        tiles=replace(INTERPRETER_TILES, rows=32, tma=False),
    ),
}
SKEWS = ("none", "one_expert", "one_rank")


def build(rank, world, case, skew, max_tokens, **fused_options):
    spec = CASES[case]
    shape = spec["shape"]
    torch.manual_seed(0)
    full = ExpertLayer(**shape)
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    with torch.no_grad():
        if skew == "one_expert":      # every token's first choice is the last expert
            full.gate.weight[-1] = 0.0
            full.gate.weight[-1, 0] = 10.0
        elif skew == "one_rank":      # every choice lands on the last rank's experts
            local = shape["num_experts"] // world
            full.gate.weight[-local:, 0] += 10.0
    fabric = None
    group = dist.group.WORLD if world > 1 else None
    fused = ExpertLayer(**shape, backend="kosmos", group=group, max_tokens_per_rank=max_tokens,
                        workers_per_rank=spec["workers"], fused_options=dict(tiles=spec.get("tiles"), **fused_options))
    fused.load_full_state_dict(full.state_dict())
    return full, fused


def tokens(rank, counts, hidden, seed, positive):
    out = []
    for r, n in enumerate(counts):
        g = torch.Generator().manual_seed(seed * 100 + r)
        x = torch.randn(n, hidden, generator=g)
        if positive:
            x[:, 0] = x[:, 0].abs() + 1.0
        out.append(x)
    return out


def check_case(rank, world, case, skew):
    spec = CASES[case]
    counts = spec["counts"][:world]
    full, fused = build(rank, world, case, skew, max_tokens=max(counts) + 3)
    hidden = spec["shape"]["hidden_size"]
    # Two calls with different batches: the second runs on the next epoch and parity, and
    # on the counters the first call's last worker reset.
    for call in range(2):
        per_rank = tokens(rank, counts if call == 0 else counts[::-1], hidden, seed=call + 1,
                          positive=skew != "none")
        with torch.no_grad():
            out = fused(per_rank[rank])
            ref = full(torch.cat(per_rank))
        start = sum(len(x) for x in per_rank[:rank])
        # fp32 throughout; the kernel sums in another order, so scale atol with the output.
        atol = 1e-5 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(out, ref[start:start + len(per_rank[rank])], rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{case}/{skew} call {call} rank {rank}: {m}")
        # This rank's assignment counts equal the reference's on this rank's tokens.
        mine = torch.bincount(full.gate(per_rank[rank]).experts.reshape(-1), minlength=full.config.num_experts)
        assert torch.equal(fused.tokens_per_expert, mine)
        if skew == "one_expert" and len(per_rank[rank]):
            assert fused.tokens_per_expert[-1] == len(per_rank[rank])
        if skew == "one_rank":
            local = full.config.num_experts // world
            assert fused.tokens_per_expert[:-local].sum() == 0


def check_cases(rank, world, items):
    for case, skew in items:
        check_case(rank, world, case, skew)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_matches_reference(world):
    items = [(case, "none") for case in CASES]
    run_world(world, check_cases, items, env=INTERPRET)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_skewed_routing(world):
    items = [("softmax", "one_expert"), ("sigmoid_group_shared", "one_rank"), ("softmax_shared", "one_rank"),
             ("softmax_rows32", "one_expert")]
    run_world(world, check_cases, items, env=INTERPRET)


def check_weight_changes(rank, world):
    """A call after the weights changed computes with the new ones, whether they were updated in
    place (as an optimizer does) or replaced by new tensors (the launcher caches the weights'
    TMA descriptors between calls)."""
    shape = CASES["softmax_shared"]["shape"]
    torch.manual_seed(0)
    full = ExpertLayer(**shape)
    fused = ExpertLayer(**shape, backend="kosmos", max_tokens_per_rank=32, workers_per_rank=2,
                        fused_options=dict(tiles=INTERPRETER_TILES))
    fused.load_full_state_dict(full.state_dict())
    x = torch.randn(21, shape["hidden_size"])
    for change in ("none", "in_place", "new_tensors"):
        with torch.no_grad():
            if change == "in_place":
                for layer in (full, fused):
                    layer.experts.down_proj.mul_(-2.0)
                    layer.shared_experts.up_proj.weight.add_(0.5)
            elif change == "new_tensors":
                gate_up = torch.randn_like(full.experts.gate_up_proj)
                gate = torch.randn_like(full.shared_experts.gate_proj.weight)
                for layer in (full, fused):
                    layer.experts.gate_up_proj = torch.nn.Parameter(gate_up.clone())
                    layer.shared_experts.gate_proj.weight = torch.nn.Parameter(gate.clone())
            out, ref = fused(x), full(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                   msg=lambda m: f"after {change}: {m}")


def test_weight_changes_between_calls():
    run_world(1, check_weight_changes, env=INTERPRET)


def check_peer_never_launches(rank, world):
    from kosmos_moe.fused import ExpertLayerTimeout

    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", group=dist.group.WORLD, max_tokens_per_rank=8)
    if rank == 1:
        layer.fused().prepare(torch.float32)  # builds its workspace (a collective), never launches
        return
    layer.fused().wait_bound = 30
    with pytest.raises(ExpertLayerTimeout, match="rank 0 of 2 .*count-exchange signal of rank 1"):
        with torch.no_grad():
            layer(torch.randn(5, 16))
    with pytest.raises(ExpertLayerTimeout):  # a failed world stays failed
        with torch.no_grad():
            layer(torch.randn(5, 16))


def test_timeout_names_rank_and_signal():
    run_world(2, check_peer_never_launches, env=INTERPRET)


def check_bad_calls(rank, world):
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="9 tokens on rank 0, but the layer was built for max_tokens_per_rank=8"):
        with torch.no_grad():
            layer(torch.randn(9, 16))
    with torch.no_grad():
        assert layer(torch.randn(0, 16)).shape == (0, 16)
        assert layer(torch.randn(2, 3, 16)).shape == (2, 3, 16)


def test_bad_calls_are_refused():
    run_world(1, check_bad_calls, env=INTERPRET)


def test_kosmos_needs_max_tokens():
    with pytest.raises(ValueError, match="pass max_tokens_per_rank"):
        ExpertLayer(16, 16, 4, 2, backend="kosmos")


def test_bad_tile_sizes_are_refused():
    # Named at construction, not as a Triton error deep in the compile of the whole kernel.
    with pytest.raises(ValueError, match=r"Tiles: .*rows=96, down_stages=0"):
        replace(INTERPRETER_TILES, rows=96, down_stages=0)
    with pytest.raises(ValueError, match=r"BackwardTiles: .*dx_cols=100, wgrad_strip=0"):
        BackwardTiles(dx_cols=100, wgrad_strip=0)
    replace(INTERPRETER_TILES, stages=3, down_stages=5)  # depths need not be powers of two


def check_cpu_needs_interpreter(rank, world):
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", max_tokens_per_rank=8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with torch.no_grad():
            layer(torch.randn(3, 16))


def test_cpu_without_interpreter_is_refused():
    run_world(1, check_cpu_needs_interpreter, env={"TRITON_INTERPRET": "0"})
