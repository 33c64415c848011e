"""The fused forward kernel under Triton's interpreter, in emulated worlds of CPU processes.

Each rank is its own process (the interpreter runs a grid's programs one after another) and
peers share workspaces through /dev/shm. Every case is compared with the reference backend
of one rank holding all experts, on the concatenation of every rank's tokens.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from fused_cases import CASES, assert_skew_took, build, tokens
from kosmos_moe import ExpertLayer
from kosmos_moe.workspace import (
    GPU_BACKWARD_TILES, GPU_BACKWARD_TILES_TWO_PER_SM, INTERPRETER_TILES, BackwardTiles, gpu_backward_tiles,
)
from multiprocess import INTERPRET, run_world


def check_case(rank, world, case, skew):
    spec = CASES[case]
    counts = spec["counts"][:world]
    full, fused = build(world, case, skew, max_tokens=max(counts) + 3)
    hidden = spec["shape"]["hidden_size"]
    # Two calls with different batches: the second runs on the next epoch and parity, and
    # on the counters the first call's last worker reset.
    for call in range(2):
        per_rank = tokens(counts if call == 0 else counts[::-1], hidden, seed=call + 1,
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
        assert_skew_took(fused, skew, world, len(per_rank[rank]), f"{case}/{skew} call {call} rank {rank}")


def check_cases(rank, world, items):
    for case, skew in items:
        check_case(rank, world, case, skew)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_matches_reference(world):
    items = [(case, "none") for case in CASES]
    run_world(world, check_cases, items, env=INTERPRET)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_skewed_routing(world):
    """Every token's first choice one expert (both routers); at world 2, every choice on the
    last rank's experts (at world 1 all experts are the last rank's: nothing to skew)."""
    items = [("softmax", "one_expert"), ("sigmoid_group", "one_expert"), ("softmax_rows32", "one_expert")]
    if world > 1:
        items += [("sigmoid_group_shared", "one_rank"), ("softmax_shared", "one_rank")]
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
    torch.manual_seed(0)
    full = ExpertLayer(16, 16, 4, 2)
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", max_tokens_per_rank=8)
    layer.load_full_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="9 tokens on rank 0, but the layer was built for max_tokens_per_rank=8"):
        with torch.no_grad():
            layer(torch.randn(9, 16))
    # The refused call left nothing behind: the next calls, empty and with leading dimensions
    # (flattened into 6 tokens), compute what the reference does.
    with torch.no_grad():
        for x in (torch.randn(0, 16), torch.randn(2, 3, 16), torch.randn(8, 16)):
            out = layer(x)
            assert out.shape == x.shape
            torch.testing.assert_close(out, full(x), rtol=1e-5, atol=1e-5)


def test_bad_calls_are_refused():
    run_world(1, check_bad_calls, env=INTERPRET)


def check_one_rank_refuses(rank, world, bad):
    from kosmos_moe.fused import ExpertLayerTimeout

    # fp32_gate: fp16 experts beside an fp32 router weight; the refusing rank joins its peer's
    # collectives in the experts' dtype (it once took the gate's, and raised a dtype error).
    dtype = torch.float16 if bad == "fp32_gate" else torch.float32
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", group=dist.group.WORLD, max_tokens_per_rank=8, dtype=dtype)
    layer.gate.float()
    layer.fused().wait_bound = 30
    with torch.no_grad():
        if rank == 0:
            x, error, match = {
                "tokens": (torch.randn(9, 16), ValueError,
                           "9 tokens on rank 0, but the layer was built for max_tokens_per_rank=8"),
                "fp32_gate": (torch.randn(9, 16, dtype=dtype), ValueError,
                              "9 tokens on rank 0, but the layer was built for max_tokens_per_rank=8"),
                "hidden": (torch.randn(5, 12), ValueError, "last dimension hidden_size=16"),
                "dtype": (torch.randn(5, 16, dtype=torch.float64), TypeError, "has dtype torch.float64"),
            }[bad]
            with pytest.raises(error, match=match):
                layer(x)
            # Its peer launched without it: this rank's layer is failed too, not reusable.
            with pytest.raises(ExpertLayerTimeout, match="rank 0 of 2 refused a forward call"):
                layer(torch.randn(5, 16, dtype=dtype))
        else:
            with pytest.raises(ExpertLayerTimeout, match="rank 1 of 2 .*count-exchange signal of rank 0"):
                layer(torch.randn(5, 16, dtype=dtype))


@pytest.mark.parametrize("bad", ["tokens", "hidden", "dtype", "fp32_gate"])
def test_one_rank_refusing_its_first_call_fails_every_rank(bad):
    """A first call refused on one rank (more tokens than the bound, a wrong width or dtype):
    that rank still joins the workspace's collective, so its peer is not blocked there but
    times out waiting for its launch and names it."""
    run_world(2, check_one_rank_refuses, bad, env=INTERPRET)


def test_kosmos_needs_max_tokens():
    with pytest.raises(ValueError, match="pass max_tokens_per_rank"):
        ExpertLayer(16, 16, 4, 2, backend="kosmos")


def test_bad_tile_sizes_are_refused():
    # Named at construction, not as a Triton error deep in the compile of the whole kernel.
    with pytest.raises(ValueError, match=r"Tiles: .*rows=96, down_stages=0"):
        replace(INTERPRETER_TILES, rows=96, down_stages=0)
    with pytest.raises(ValueError, match=r"BackwardTiles: .*dx_cols=100, wgrad_strip=0"):
        BackwardTiles(dx_cols=100, wgrad_strip=0)
    with pytest.raises(ValueError, match=r"Tiles: .*workers_per_sm=0"):
        replace(INTERPRETER_TILES, workers_per_sm=0)
    with pytest.raises(ValueError, match=r"Tiles: .*many_experts_from=-1 \(a threshold"):
        replace(INTERPRETER_TILES, many_experts_from=-1)
    replace(INTERPRETER_TILES, stages=3, down_stages=5, workers_per_sm=3)  # counts need not be powers of two
    replace(INTERPRETER_TILES, many_experts_from=100, merged_lookup_from=0)  # thresholds neither


def test_weight_gradient_strips_halve_whole_rows():
    # One strip would be a whole dW[g;u] row at Qwen3's 16 column blocks, not at DeepSeek-V3's 28.
    t = GPU_BACKWARD_TILES
    assert (t.wgrad_cols, t.wgrad_strip) == (256, 16)
    assert [t.wgrad_strip_for(h) for h in (7168, 4097, 4096, 1544, 256, 1)] == [16, 16, 8, 4, 1, 1]
    assert replace(t, wgrad_split_whole_rows=False).wgrad_strip_for(4096) == 16
    assert t.kernel_constants(hidden=4096)["WS"] == 8 and t.kernel_constants(hidden=7168)["WS"] == 16


def test_backward_runs_two_workers_per_sm_where_experts_have_few_rows():
    # From 128 local experts, where the forward keeps every row's projections: a kernel that may
    # redo them needs more shared memory than two workers of an SM have.
    assert gpu_backward_tiles(128) is gpu_backward_tiles(256) is GPU_BACKWARD_TILES_TWO_PER_SM
    assert gpu_backward_tiles(127) is gpu_backward_tiles(256, keeps_every_row=False) is GPU_BACKWARD_TILES
    two, one = GPU_BACKWARD_TILES_TWO_PER_SM, GPU_BACKWARD_TILES
    assert (two.warps, two.workers_per_sm, one.warps, one.workers_per_sm) == (4, 2, 8, 1)
    assert two.rows == one.rows  # the workspace, sized by row tiles, is the same for both


def check_cpu_needs_interpreter(rank, world):
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", max_tokens_per_rank=8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with torch.no_grad():
            layer(torch.randn(3, 16))


def test_cpu_without_interpreter_is_refused():
    run_world(1, check_cpu_needs_interpreter, env={"TRITON_INTERPRET": "0"})
