"""The fused forward kernel on a GPU, bf16, in emulated worlds of 1, 2, 3, 4 and 8 ranks.

Each case runs every rank's layer in turn on its own stream (EmulatedWorld.run): a host sync
anywhere in a rank's path would stall the world until a wait bound fires, and torch's sync
debug mode turns any synchronising torch call on that path into an error.
The fused output is compared with an fp32 evaluation of the same bf16 weights; its error must
stay within twice the error of the bf16 reference backend on the same inputs.
"""

from dataclasses import replace

import pytest
import torch

from accuracy import assert_within
from fused_cases import GPU_COUNTS, GPU_SHAPES, emulated_gpu_world, fp32_truth, skew_tokens

from kosmos_moe.workspace import GPU_TILES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel's GPU path needs a CUDA device"),
]

# About a few seconds of polling: a stalled world fails fast instead of after a minute.
TEST_WAIT_BOUND = 1 << 22


def make_world(case, world, skew="none", workers=None, max_tokens=768, tiles=None):
    return emulated_gpu_world(case, world, skew, workers, max_tokens, TEST_WAIT_BOUND, tiles)


def run_and_check(case, world, skew="none", workers=None, calls=2, tiles=None):
    full, emulated, layers = make_world(case, world, skew, workers, tiles=tiles)
    hidden = GPU_SHAPES[case]["hidden_size"]
    truth_layer = fp32_truth(full, case)
    for call in range(calls):
        g = torch.Generator(device="cuda").manual_seed(call)
        counts = GPU_COUNTS[:world] if call % 2 == 0 else GPU_COUNTS[:world][::-1]
        xs = [torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16) for n in counts]
        if skew != "none":
            xs = [skew_tokens(x) for x in xs]
        with torch.no_grad():
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = emulated.run(lambda r, x: layers[r](x), xs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            x_all = torch.cat(xs)
            ref = full(x_all)
            truth = truth_layer(x_all.float())
        for layer in layers:
            layer.fused().raise_if_failed()
        # The outputs are one bf16 rounding from an fp32 sum: a floor of 1e-3 of the scale, below
        # the backward's one-ulp floor for gradients accumulated in bf16.
        assert_within(torch.cat(outs), ref, truth, f"{case} world {world} skew {skew} call {call}: output",
                      floor=1e-3)
        # Each rank's routing statistics equal the reference router's on its tokens.
        for r, (layer, x) in enumerate(zip(layers, xs)):
            mine = torch.bincount(full.gate(x).experts.reshape(-1), minlength=full.config.num_experts)
            assert torch.equal(layer.tokens_per_expert, mine), f"{case} world {world} rank {r} routing"
    return layers


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("case", ["softmax", "sigmoid_group_shared"])
def test_emulated_world_matches_reference(case, world):
    run_and_check(case, world)


@pytest.mark.parametrize("case", ["softmax_shared", "sigmoid_group"])
def test_other_router_shared_combinations(case):
    run_and_check(case, 2)


@pytest.mark.parametrize("workers", [1, 7])
def test_forced_worker_counts(workers):
    run_and_check("sigmoid_group_shared", 2, workers=workers)


@pytest.mark.parametrize("world", [1, 3])
def test_two_workers_per_sm(world):
    # Workers of one warpgroup, two per SM: the grid is twice the SMs over the ranks, and every
    # worker of every rank is resident at once (a stranded one would stall the world).
    tiles = replace(GPU_TILES, warps=4, workers_per_sm=2, gate_up_cols=64, down_cols=128, stages=3, down_stages=3)
    layers = run_and_check("sigmoid_group_shared", world, tiles=tiles)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert layers[0].fused().workers == 2 * sms // world


@pytest.mark.parametrize("case, world", [("softmax", 1), ("sigmoid_group_shared", 3)])
def test_merged_expert_lookup(case, world):
    # Each routed tile's four expert entries looked up in one reduction: the default from 256
    # local experts (Tiles.merged_lookup_from, DeepSeek-V3 at EP=1), which no other shape here
    # reaches, so it is forced from one.
    run_and_check(case, world, tiles=replace(GPU_TILES, merged_lookup_from=1))


def test_gate_up_tickets_claimed_ahead():
    # Tiles.gate_up_claim_ahead on: a worker claims its next gate/up ticket as its previous
    # gate/up tile starts, not in the pass that reaches that queue as by default.
    run_and_check("sigmoid_group_shared", 2, tiles=replace(GPU_TILES, gate_up_claim_ahead=True))


def test_many_expert_stages():
    # The gate/up tiles' deeper pipeline from many local experts (Tiles.many_experts_from, 128;
    # no other GPU test shape has that many), forced from one.
    run_and_check("sigmoid_group_shared", 2, tiles=replace(GPU_TILES, many_experts_from=1))


def test_weight_l2_promotion():
    # Weight descriptors re-encoded with 256-byte L2 promotion (kosmos_moe.tma_promotion): the
    # hook found Triton's maps as it encodes them, replaced them, and the results are unchanged.
    from kosmos_moe import tma_promotion

    before = tma_promotion.rewrites
    run_and_check("sigmoid_group_shared", 2, tiles=replace(GPU_TILES, weight_l2_promotion=256))
    assert tma_promotion.status() is None, tma_promotion.status()
    assert tma_promotion.rewrites > before, "no weight descriptor was re-encoded"


def test_grid_beyond_residency_is_refused():
    # The default tiles (8 warps, ~147 KB of shared memory) fit one worker per SM: asking for
    # two is refused before the launch, naming what the compiled kernel needs, instead of
    # stranding half the grid.
    full, emulated, layers = make_world("softmax", 1, tiles=replace(GPU_TILES, workers_per_sm=2))
    x = torch.randn(64, GPU_SHAPES["softmax"]["hidden_size"], device="cuda").to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cannot all be resident.*fits 1 per SM"):
        layers[0](x)


def test_layers_sharing_a_workspace_on_two_streams():
    # Two layers sharing one workspace (kosmos_moe.share_workspaces), called back to back from
    # two streams with no host sync between: the second call's stream waits for the first's
    # use of the workspace, so both give what they give one after another on one stream.
    from torch import nn

    from kosmos_moe import ExpertLayer, share_workspaces
    from kosmos_moe.fabric import EmulatedWorld

    shape = GPU_SHAPES["sigmoid_group_shared"]
    world = EmulatedWorld(1, "cuda")
    torch.manual_seed(0)
    layers = nn.ModuleList(
        ExpertLayer(**shape, backend="kosmos", fabric=world.rank(0), max_tokens_per_rank=768, dtype=torch.bfloat16,
                    device="cuda", fused_options=dict(wait_bound=TEST_WAIT_BOUND))
        for _ in range(2))
    share_workspaces(layers)
    xs = [torch.randn(768, shape["hidden_size"], device="cuda").to(torch.bfloat16) for _ in layers]
    with torch.no_grad():
        one_stream = [layer(x) for layer, x in zip(layers, xs)]
        torch.cuda.synchronize()
        assert layers[0].fused().workspace is layers[1].fused().workspace
        streams = [torch.cuda.Stream() for _ in layers]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        outs = []
        for _ in range(3):
            for layer, x, s in zip(layers, xs, streams):
                with torch.cuda.stream(s):
                    outs.append(layer(x))
        torch.cuda.synchronize()
    for layer in layers:
        layer.fused().raise_if_failed()
    assert layers[0].fused().workspace.last_use[0] == streams[1].cuda_stream
    for i, out in enumerate(outs):
        assert torch.equal(out, one_stream[i % 2]), f"call {i} on stream {i % 2} differs from the one-stream run"


@pytest.mark.parametrize("skew", ["one_expert", "one_rank"])
def test_skewed_routing(skew):
    run_and_check("sigmoid_group_shared", 4, skew=skew)


def test_many_calls_reuse_the_workspace():
    run_and_check("softmax", 3, calls=6)


def test_cuda_graph_capture():
    full, emulated, (layer,) = make_world("sigmoid_group_shared", 1)
    truth = fp32_truth(full, "sigmoid_group_shared")
    static_x = torch.randn(300, GPU_SHAPES["sigmoid_group_shared"]["hidden_size"], device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        layer(static_x)  # builds the workspace and compiles, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        for seed in range(3):
            static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            graph.replay()
            expected = layer(static_x)  # eager call on the same workspace: the epochs advanced in memory
            torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
            assert_within(static_out, full(static_x), truth(static_x.float()), f"replay {seed}", floor=1e-3)
    layer.fused().raise_if_failed()


def test_peer_that_never_launches_times_out():
    from kosmos_moe.fused import ExpertLayerTimeout

    _, emulated, layers = make_world("softmax", 2)
    layers[0].fused().wait_bound = 1 << 14
    with torch.no_grad():
        layers[0](torch.randn(10, GPU_SHAPES["softmax"]["hidden_size"], device="cuda").to(torch.bfloat16))
    with pytest.raises(ExpertLayerTimeout, match="rank 0 of 2 .*count-exchange signal of rank 1"):
        layers[0].fused().raise_if_failed()
