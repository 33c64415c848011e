"""The fused backward on a GPU, bf16, in emulated worlds of 1, 2, 4 and 8 ranks.

Each rank's forward and backward run on its own stream (EmulatedWorld.run), every rank's
launches issued before any host sync and under torch's sync debug mode: a synchronising call
on a rank's path would stall the world (its peers' kernels wait for it) and is an error here.

Gradients of ``loss = sum_r sum(out_r * g_r)`` are compared with an fp32 evaluation of the same
bf16 weights (the truth), on the concatenation of every rank's tokens for the input and the
expert gradients (rank r's slice of experts) and on rank r's own tokens for the replicated
router and shared-expert weights (each rank's ``.grad`` is its own tokens' gradient). The fused
error must stay within twice the error of the bf16 reference backend on the same inputs, the
standard of tests/test_fused_gpu.py for the outputs.
"""

import pytest
import torch

from accuracy import assert_within
from fused_cases import GPU_COUNTS, GPU_SHAPES, emulated_gpu_world, fp32_truth, skew_tokens
from kosmos_moe.workspace import GPU_BACKWARD_TILES_TWO_PER_SM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel's GPU path needs a CUDA device"),
]

SHAPES, COUNTS = GPU_SHAPES, GPU_COUNTS  # the forward GPU tests' (tests/fused_cases.py)
DEEPSEEK_COUNTS = [1000, 1017, 0, 993, 1024, 1, 998, 1011]
# Polls before a kernel gives up. 1 << 22 polls of the count exchange took under 1.6 s on the
# H200 (a forward timed out while its peer's launch came 1.57 s after its own): too tight for a
# first call, whose host path may take a second. 1 << 24 is a few seconds.
TEST_WAIT_BOUND = 1 << 24

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
REPLICATED = ("gate.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
              "shared_experts.down_proj.weight")

# Tolerance: tests/accuracy.py (twice the bf16 reference's error against the fp32 truth).
# Ranks with fewer tokens skip the per-rank router comparison (see check_against_reference).
ROUTER_MIN_TOKENS = 64


def make_world(case, world, skew="none", max_tokens=768, workers=None, backward_tiles=None):
    full, emulated, layers = emulated_gpu_world(case, world, skew, workers, max_tokens, TEST_WAIT_BOUND,
                                                backward_tiles=backward_tiles)
    return full, fp32_truth(full, case), emulated, layers


def batch(case, counts, seed, skew="none"):
    """Per-rank bf16 tokens (the forward tests' generator and seeds) and cotangents."""
    hidden = SHAPES[case]["hidden_size"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16) for n in counts]
    if skew != "none":
        xs = [skew_tokens(x) for x in xs]
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    gs = [torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16) for n in counts]
    return xs, gs


class SyncIsError:
    """Any synchronising torch call inside is an error (a stalled emulated world otherwise)."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def run_world(full, emulated, layers, batches, pattern="fused"):
    """Forward and backward of every batch on every rank; returns (outputs, x grads) per batch.

    ``fused``: each rank's forward then its backward on its stream, batch after batch (the
    later ranks' forwards are launched after the earlier ranks' backwards, which wait for them
    on the device). ``split``: all ranks' forwards of all batches, then all backwards, in
    reverse batch order (two forwards before their backwards: checkpointing, accumulation).
    """
    # A rank's first call loads CUDA modules (its shared expert's cuBLAS GEMMs at its token
    # count, casts) lazily, and a load waits for the peers' spinning kernels: on the H200 that
    # stalled the host 1.6-6 s between two ranks' launches until a kernel timed out.
    for xs, gs in batches:
        emulated.rehearse(full, xs, gs)
    leaves = [[x.clone().requires_grad_(True) for x in xs] for xs, _ in batches]

    def fwd_bwd(r, x, g):
        out = layers[r](x)
        assert out.grad_fn is not None
        torch.autograd.backward(out, g)
        return out.detach()

    with SyncIsError():
        if pattern == "fused":
            outs = [emulated.run(fwd_bwd, xs, gs) for xs, (_, gs) in zip(leaves, batches)]
        else:
            outs = [emulated.run(lambda r, x: layers[r](x), xs) for xs in leaves]
            for b in reversed(range(len(batches))):
                emulated.run(lambda r, o, g: torch.autograd.backward(o, g), outs[b], batches[b][1])
    for layer in layers:
        layer.fused().raise_if_failed()
    return [[o.detach() for o in per_rank] for per_rank in outs], [[x.grad for x in xs] for xs in leaves]


def reference(layer, batches, dtype):
    """Outputs, x grads per batch and parameter grads accumulated over the batches (in the layer's dtype)."""
    layer.zero_grad(set_to_none=True)
    outs, x_grads = [], []
    for xs, gs in batches:
        x = torch.cat(xs).to(dtype).requires_grad_(True)
        out = layer(x)
        out.backward(torch.cat(gs).to(dtype))
        outs.append(out.detach().float())
        x_grads.append(x.grad.float())
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).float() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return outs, x_grads, grads


def check_against_reference(full, truth, layers, batches, outs, x_grads, what):
    ref_outs, ref_x, ref = reference(full, batches, torch.bfloat16)
    tru_outs, tru_x, tru = reference(truth, batches, torch.float32)
    for b in range(len(batches)):
        assert_within(torch.cat(outs[b]), ref_outs[b], tru_outs[b], f"{what} batch {b}: output")
        assert_within(torch.cat(x_grads[b]), ref_x[b], tru_x[b], f"{what} batch {b}: x.grad")
    for name in EXPERTS:
        grads = [dict(layer.named_parameters())[name].grad for layer in layers]
        assert all(g is not None for g in grads), f"{what}: {name} has no gradient on some rank"
        assert_within(torch.cat(grads), ref[name], tru[name], f"{what}: {name}", per_expert=True)
    assert all(layer.gate.weight.grad is not None for layer in layers), f"{what}: gate.weight has no gradient on some rank"
    router_sum = sum(layer.gate.weight.grad.float() for layer in layers)
    assert_within(router_sum, ref["gate.weight"], tru["gate.weight"], f"{what}: gate.weight summed over the ranks")
    for r, layer in enumerate(layers):
        assert "gate.e_score_correction_bias" not in dict(layer.named_parameters())
        if layer.gate.e_score_correction_bias is not None:
            assert layer.gate.e_score_correction_bias.grad is None
        own = [([xs[r]], [gs[r]]) for xs, gs in batches]
        own_tokens = sum(len(xs[r]) for xs, _ in batches)
        _, _, ref_own = reference(full, own, torch.bfloat16)
        _, _, tru_own = reference(truth, own, torch.float32)
        for name, p in layer.named_parameters():
            if name not in REPLICATED:
                continue
            if name == "gate.weight" and 0 < own_tokens < ROUTER_MIN_TOKENS:
                # The router gradient of a handful of tokens is a sum of few outer products of
                # d logits, whose softmax/sigmoid backward cancels; the max error of so few terms
                # is too noisy to compare against twice the reference's. Such ranks are held by
                # the sum over the ranks above (and by the CPU tests, per rank, in fp32).
                continue
            assert_within(p.grad, ref_own[name], tru_own[name], f"{what} rank {r}: {name} (own tokens)")


def check(case, world, skew="none", pattern="fused", calls=1, counts=None, max_tokens=768, workers=None,
          backward_tiles=None):
    full, truth, emulated, layers = make_world(case, world, skew, max_tokens, workers, backward_tiles)
    counts = counts or COUNTS[:world]
    what = f"{case} world {world} skew {skew} {pattern}"
    if pattern == "fused":
        # Separate calls, gradients cleared in between; the second one reuses the workspaces.
        for call in range(calls):
            batches = [batch(case, counts if call % 2 == 0 else counts[::-1], call, skew)]
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            outs, x_grads = run_world(full, emulated, layers, batches)
            check_against_reference(full, truth, layers, batches, outs, x_grads, f"{what} call {call}")
    else:
        # Both batches' forwards before their backwards; the gradients accumulate over both.
        batches = [batch(case, counts, 0, skew), batch(case, counts[::-1], 1, skew)]
        outs, x_grads = run_world(full, emulated, layers, batches, pattern)
        check_against_reference(full, truth, layers, batches, outs, x_grads, what)
    return layers


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("case", ["softmax", "sigmoid_group_shared"])
def test_backward_matches_reference(case, world):
    check(case, world, calls=2)


@pytest.mark.parametrize("case", ["softmax_shared", "sigmoid_group"])
def test_other_router_shared_combinations(case):
    check(case, 2)


@pytest.mark.parametrize("workers", [1, 7])
def test_forced_worker_counts(workers):
    """One worker per rank runs every task kind in turn; seven leave most SMs free."""
    check("sigmoid_group_shared", 2, workers=workers)


def test_two_workers_per_sm():
    """The backward's many-expert tiles (two workers of one warpgroup per SM, 128 x 128 tiles;
    kosmos_moe.workspace.gpu_backward_tiles) on a shape of few experts, where every tile kind
    runs, at one rank, where they are chosen (every row's projections kept)."""
    layers = check("sigmoid_group_shared", 1, calls=2, backward_tiles=GPU_BACKWARD_TILES_TWO_PER_SM)
    assert layers[0].fused().backward.workers == 2 * layers[0].fused().workers


def test_profiled_launches_report_tasks_and_worker_spans():
    """Profiling builds (timers in the kernels) give the same gradients, count every task kind
    that must have run, and record each worker's start and exit of the last call."""
    case, world = "sigmoid_group_shared", 2
    full, truth, emulated, layers = make_world(case, world, workers=9)
    launchers = [launch for layer in layers for launch in (layer.fused(), layer.fused().backward)]
    for launch in launchers:
        launch.profile = launch.new_profile()
    batches = [batch(case, COUNTS[:world], 0)]
    outs, x_grads = run_world(full, emulated, layers, batches)
    check_against_reference(full, truth, layers, batches, outs, x_grads, f"{case} world {world} profiled")
    torch.cuda.synchronize()
    for launch in launchers:
        report = launch.profile_report()
        ran = ("gate_up", "down", "fold") if launch.direction == "forward" else ("dx", "weight_grad", "fold")
        for kind in ran:
            assert report[kind]["passes"] > 0 and report[kind]["seconds"] > 0, (launch.direction, kind, report)
        spans = launch.worker_spans_us()
        assert spans.shape == (9, 2)
        assert spans[:, 0].min() == 0 and bool((spans[:, 1] > spans[:, 0]).all()), spans
        # Every worker of a launch runs at once (a persistent grid): none starts after another leaves.
        assert spans[:, 0].max() < spans[:, 1].min(), spans
        assert spans[:, 1].max() < 10e6, spans  # under 10 s: timestamps of this call, not stale ones


@pytest.mark.parametrize("skew", ["one_expert", "one_rank"])
def test_skewed_routing(skew):
    check("sigmoid_group_shared", 4, skew=skew)


@pytest.mark.parametrize("world", [1, 4])
def test_forwards_before_backwards(world):
    """All ranks' forwards of two batches, then the backwards, the second batch's first."""
    check("sigmoid_group_shared", world, pattern="split")


def test_gradient_accumulation():
    """Two forward+backward calls without clearing .grad: the sum of both batches' gradients."""
    case, world = "softmax_shared", 4
    full, truth, emulated, layers = make_world(case, world)
    batches = [batch(case, COUNTS[:world], 0), batch(case, COUNTS[:world][::-1], 1)]
    outs, x_grads = [], []
    for b in batches:
        o, xg = run_world(full, emulated, layers, [b])
        outs += o
        x_grads += xg
    check_against_reference(full, truth, layers, batches, outs, x_grads, f"{case} world {world} accumulation")


@pytest.mark.parametrize("world", [2, 8])
def test_no_grad_forward_equals_grad_forward(world):
    """Under no_grad the kernel also runs the shared expert and saves nothing: same function."""
    case = "sigmoid_group_shared"
    full, truth, emulated, layers = make_world(case, world)
    batches = [batch(case, COUNTS[:world], 0)]
    outs, _ = run_world(full, emulated, layers, batches)
    with torch.no_grad(), SyncIsError():
        plain = emulated.run(lambda r, x: layers[r](x), batches[0][0])
    for layer in layers:
        layer.fused().raise_if_failed()
    assert all(o.grad_fn is None for o in plain)
    x_all = torch.cat(batches[0][0])
    with torch.no_grad():
        ref = full(x_all).float()
        tru = truth(x_all.float())
    # Both run the shared expert inside the same kernel; each must be as close to the truth
    # as the forward tests demand.
    assert_within(torch.cat(plain), ref, tru, f"{case} world {world}: no-grad output")
    assert_within(torch.cat(outs[0]), ref, tru, f"{case} world {world}: grad-mode output")


@pytest.mark.parametrize("world", [2, 4])
def test_backward_is_deterministic(world):
    """Weight gradients are reduced in a fixed order: two identical runs, bitwise equal results."""
    case = "sigmoid_group_shared"
    full, truth, emulated, layers = make_world(case, world)
    batches = [batch(case, COUNTS[:world], 0)]
    results = []
    for _ in range(2):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        outs, x_grads = run_world(full, emulated, layers, batches)
        grads = [{name: p.grad.clone() for name, p in layer.named_parameters()} for layer in layers]
        results.append((outs[0], x_grads[0], grads))
    (outs_a, xg_a, grads_a), (outs_b, xg_b, grads_b) = results
    for r in range(world):
        assert torch.equal(outs_a[r], outs_b[r]), f"rank {r}: outputs differ between identical runs"
        assert torch.equal(xg_a[r], xg_b[r]), f"rank {r}: x.grad differs between identical runs"
        for name in grads_a[r]:
            assert torch.equal(grads_a[r][name], grads_b[r][name]), f"rank {r}: {name}.grad differs between identical runs"


def test_deepseek_v3_like_shape():
    """64 experts, top-8 of 4 of 8 groups, 1 shared expert, 8 ranks of ~1000 tokens (one empty, one of 1)."""
    check("deepseek_v3_like", 8, counts=DEEPSEEK_COUNTS, max_tokens=1024)
