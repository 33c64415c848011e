"""The fused forward kernel on a GPU, bf16, in emulated worlds of 1, 2, 3, 4 and 8 ranks.

Each case runs every rank's layer in turn on its own stream (EmulatedWorld.run): a host sync
anywhere in a rank's path would stall the world until a wait bound fires, and torch's sync
debug mode turns any synchronising torch call on that path into an error.
The fused output is compared with an fp32 evaluation of the same bf16 weights; its error must
stay within twice the error of the bf16 reference backend on the same inputs.
"""

import pytest
import torch

from kosmos_moe import ExpertLayer
from kosmos_moe.fabric import EmulatedWorld

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel's GPU path needs a CUDA device"),
]

# Hidden and intermediate sizes that are no power of two; 48 experts divide over 1, 2, 3, 4, 8.
SHAPES = {
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
}
# About a few seconds of polling: a stalled world fails fast instead of after a minute.
TEST_WAIT_BOUND = 1 << 22
# Uneven, not a multiple of any tile, one rank without tokens.
COUNTS = [517, 1, 300, 0, 129, 700, 64, 255]


def make_world(case, world, skew="none", workers=None, max_tokens=768):
    torch.manual_seed(0)
    shape = SHAPES[case]
    full = ExpertLayer(**shape, dtype=torch.bfloat16, device="cuda")
    if full.gate.e_score_correction_bias is not None:
        full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    with torch.no_grad():
        if skew == "one_expert":
            full.gate.weight[-1] = 0.0
            full.gate.weight[-1, 0] = 10.0
        elif skew == "one_rank":
            full.gate.weight[-shape["num_experts"] // world:, 0] += 10.0
    emulated = EmulatedWorld(world, "cuda")
    layers = []
    for r in range(world):
        layer = ExpertLayer(**shape, backend="kosmos", fabric=emulated.rank(r), max_tokens_per_rank=max_tokens,
                            workers_per_rank=workers, dtype=torch.bfloat16, device="cuda",
                            fused_options=dict(wait_bound=TEST_WAIT_BOUND))
        layer.load_full_state_dict(full.state_dict())
        layers.append(layer)
    for layer in layers:
        layer.fused().prepare(torch.bfloat16)  # the workspace allocation syncs; do it before the runs
    return full, emulated, layers


def run_and_check(case, world, skew="none", workers=None, calls=2):
    full, emulated, layers = make_world(case, world, skew, workers)
    hidden = SHAPES[case]["hidden_size"]
    truth_layer = ExpertLayer(**SHAPES[case], dtype=torch.float32, device="cuda")
    truth_layer.load_state_dict({k: v.float() for k, v in full.state_dict().items()})
    for call in range(calls):
        g = torch.Generator(device="cuda").manual_seed(call)
        counts = COUNTS[:world] if call % 2 == 0 else COUNTS[:world][::-1]
        xs = [torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16) for n in counts]
        if skew != "none":
            for x in xs:
                x[:, 0] = x[:, 0].abs() + 1.0
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
        fused = torch.cat(outs).float()
        err_fused = (fused - truth).abs().max().item()
        err_ref = (ref.float() - truth).abs().max().item()
        scale = truth.abs().max().item()
        assert err_fused <= max(2 * err_ref, 1e-3 * scale), (
            f"{case} world {world} skew {skew} call {call}: fused error {err_fused:.3g}, "
            f"bf16 reference error {err_ref:.3g}, output scale {scale:.3g}"
        )
        mean_fused = (fused - truth).abs().mean().item()
        mean_ref = (ref.float() - truth).abs().mean().item()
        assert mean_fused <= 2 * mean_ref + 1e-6, (case, world, call, mean_fused, mean_ref)
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


@pytest.mark.parametrize("skew", ["one_expert", "one_rank"])
def test_skewed_routing(skew):
    run_and_check("sigmoid_group_shared", 4, skew=skew)


def test_many_calls_reuse_the_workspace():
    run_and_check("softmax", 3, calls=6)


def test_cuda_graph_capture():
    full, emulated, (layer,) = make_world("sigmoid_group_shared", 1)
    static_x = torch.randn(300, SHAPES["sigmoid_group_shared"]["hidden_size"], device="cuda").to(torch.bfloat16)
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
            ref = full(static_x)
            assert (static_out.float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()
    layer.fused().raise_if_failed()


def test_peer_that_never_launches_times_out():
    from kosmos_moe.fused import ExpertLayerTimeout

    _, emulated, layers = make_world("softmax", 2)
    layers[0].fused().wait_bound = 1 << 14
    with torch.no_grad():
        layers[0](torch.randn(10, SHAPES["softmax"]["hidden_size"], device="cuda").to(torch.bfloat16))
    with pytest.raises(ExpertLayerTimeout, match="rank 0 of 2 .*count-exchange signal of rank 1"):
        layers[0].fused().raise_if_failed()
