"""The fused backward under Triton's interpreter, in emulated worlds of CPU processes, fp32.

Same worlds, cases and tokens as tests/test_fused_cpu.py (tests/fused_cases.py, so
that the routing of every token is one the forward tests already check). Each rank runs
``loss = sum(out_r * g_r)`` backward through its fused layer; the reference is one rank of
``backend="reference"`` holding all experts:

* on the concatenation of every rank's tokens and cotangents: the outputs, ``x.grad`` (this
  rank's rows) and the expert gradients (this rank's slice of experts), because a rank's
  experts see rows from every rank;
* on this rank's tokens only: the router and shared-expert gradients, which are replicated
  parameters: each rank's ``.grad`` holds the gradient of its own tokens (the layer does not
  all-reduce them), and their sum over the ranks is the full reference's gradient.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from fused_cases import ALL_CASES, CASES, EDGE_CASES, assert_skew_took, build, tokens
from kosmos_moe import ExpertLayer
from multiprocess import INTERPRET, run_world

# fp32 on both sides; the kernel sums in other orders and tiles (rows in tiles of 16, the
# weight gradients as per-tile partial sums, the SwiGLU activations recomputed). Every
# gradient here is a chain of fp32 dot products of at most a few hundred terms (the longest:
# an expert's weight gradient, summed over the <= W*40 rows routed to it). A sum of n terms of
# random sign rounds to about sqrt(n) * 2**-24 of its largest partial sum, i.e. ~1e-6 of the
# largest entry of the result for n ~ 160. Measured on these cases: the fp32 reference is
# within 4.3e-7 of an fp64 evaluation (relative to the largest entry; per expert for the
# expert weights), and the kernel within 5.3e-7 of the fp32 reference, for the input, expert
# and shared-expert gradients. atol = 2e-5 of the largest entry of the expected gradient
# (per expert for the expert weights, so that an expert few rows reached is held to its own
# scale) leaves a margin of more than 30x, while any indexing or accumulation bug (a missing
# row, a wrong expert, a race) shows up at O(1) of the scale. rtol 1e-4 covers the larger
# entries the same way. An expected gradient that is exactly zero (an expert no row reached,
# a rank without tokens) must come out exactly zero: nothing is accumulated there.
GRAD_RTOL, GRAD_ATOL = 1e-4, 2e-5
# The router weight's gradient goes through the softmax / sigmoid-renormalisation backward,
# d logit_e = p_e * (dp_e - sum_j p_j dp_j) and the like, which cancels: on a rank with a
# single token (softmax_shared, world 4, rank 3) the fp32 reference itself is 6.3e-6 of the
# largest entry away from fp64 and the kernel 9.1e-6 (1.1e-5 from each other). Both are
# correct fp32 results of an ill-conditioned sum, so the router gets 1e-4: ~9x that worst case,
# still far below a wrong-token or wrong-expert error.
ROUTER_GRAD_ATOL = 1e-4
# The outputs: the forward file's tolerance (one GEMM chain, no long sums).
OUT_RTOL, OUT_ATOL = 1e-5, 1e-5

ROUTER_AND_SHARED = ("gate.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                     "shared_experts.down_proj.weight")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def cotangents(counts, hidden, seed):
    """dL/d(out_r) of every rank r, seeded by r: every process builds the same list."""
    return [torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed * 100 + 50 + r))
            for r, n in enumerate(counts)]


def reference_pass(layer, xs, gs):
    """Output, x.grad and parameter grads of the reference ``layer`` on cat(xs), loss sum(out * cat(gs))."""
    layer.zero_grad(set_to_none=True)
    x = torch.cat(xs).requires_grad_(True)
    out = layer(x)
    out.backward(torch.cat(gs))
    grads = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def add_grads(a, b):
    return {name: a[name] + b[name] for name in a}


def assert_grad_close(actual, expected, what, atol=GRAD_ATOL):
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: gradient of shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=GRAD_RTOL, atol=atol * scale,
                               msg=lambda m: f"{what} (scale {scale:.3g}): {m}")


def check_param_grads(rank, world, fused, full_grads, own_grads, what):
    """Compare every parameter's .grad of the fused layer with the references.

    ``full_grads``: reference grads on all ranks' tokens; ``own_grads``: on this rank's only.
    """
    names = {name for name, _ in fused.named_parameters()}
    assert "gate.e_score_correction_bias" not in names  # a buffer: moved by the balancer, not by SGD
    bias = fused.gate.e_score_correction_bias
    if bias is not None:
        assert bias.grad is None and not bias.requires_grad, f"{what}: the correction bias got a gradient"
    params = dict(fused.named_parameters())
    first, last = fused.local_expert_range
    for name in EXPERTS:
        grad = params[name].grad
        assert grad is not None, f"{what} rank {rank}: {name} has no gradient"
        assert grad.shape == params[name].shape
        expected = full_grads[name][first:last]
        for e in range(last - first):  # each expert on its own scale: a starved expert is checked too
            assert_grad_close(grad[e], expected[e], f"{what} rank {rank}: {name}[local expert {e}]")
    for name in ROUTER_AND_SHARED:
        if name not in params:
            continue
        grad = params[name].grad
        assert grad is not None, f"{what} rank {rank}: {name} has no gradient"
        atol = ROUTER_GRAD_ATOL if name == "gate.weight" else GRAD_ATOL
        assert_grad_close(grad, own_grads[name], f"{what} rank {rank}: {name} (this rank's tokens)", atol)
        total = grad.clone()
        dist.all_reduce(total)
        assert_grad_close(total, full_grads[name], f"{what} rank {rank}: {name} summed over the ranks", atol)
    assert names <= set(EXPERTS) | set(ROUTER_AND_SHARED), names


def fused_pass(layer, x, g):
    """Forward in grad mode and backward of sum(out * g); returns the output and x.grad."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    assert out.requires_grad and out.grad_fn is not None, "a grad-mode forward must return a differentiable output"
    out.backward(g)
    assert x.grad is not None and x.grad.shape == x.shape
    return out.detach(), x.grad


def starts(counts):
    return [sum(counts[:r]) for r in range(len(counts))]


def check_case(rank, world, case, skew, counts=None, max_tokens=None, **fused_options):
    spec = ALL_CASES[case]
    counts = counts or spec["counts"][:world]
    hidden = spec["shape"]["hidden_size"]
    full, fused = build(world, case, skew, max_tokens=max_tokens or max(counts) + 3, **fused_options)
    what = f"{case}/{skew} world {world} {fused_options}"
    xs = tokens(counts, hidden, seed=1, positive=skew != "none")
    gs = cotangents(counts, hidden, seed=1)
    start, n = starts(counts)[rank], counts[rank]

    out, x_grad = fused_pass(fused, xs[rank], gs[rank])

    ref_out, ref_x_grad, full_grads = reference_pass(full, xs, gs)
    _, _, own_grads = reference_pass(full, [xs[rank]], [gs[rank]])
    atol = OUT_ATOL * max(1.0, ref_out.abs().max().item())
    torch.testing.assert_close(out, ref_out[start:start + n], rtol=OUT_RTOL, atol=atol,
                               msg=lambda m: f"{what} rank {rank} output: {m}")
    assert_grad_close(x_grad, ref_x_grad[start:start + n], f"{what} rank {rank}: x.grad")
    check_param_grads(rank, world, fused, full_grads, own_grads, what)
    assert_skew_took(fused, skew, world, n, what)
    if skew == "one_rank" and rank < world - 1:  # no row reached this rank's experts
        assert not fused.experts.gate_up_proj.grad.any() and not fused.experts.down_proj.grad.any()

    # A no-grad forward computes the same function (the grad-mode one may keep more state, so
    # compare at the forward's tolerance), keeps nothing for a backward and leaves the
    # accumulated gradients alone.
    grads_before = {name: p.grad.clone() for name, p in fused.named_parameters()}
    with torch.no_grad(), count_saves(fused) as saves:
        out_no_grad = fused(xs[rank])
    assert saves == [], f"{what}: a no-grad forward kept gate/up projections for a backward"
    assert out_no_grad.grad_fn is None and not out_no_grad.requires_grad
    torch.testing.assert_close(out_no_grad, out, rtol=OUT_RTOL, atol=atol,
                               msg=lambda m: f"{what} rank {rank} no-grad output: {m}")
    for name, p in fused.named_parameters():
        assert torch.equal(p.grad, grads_before[name]), f"{what}: a no-grad forward changed {name}.grad"
    return fused


@contextlib.contextmanager
def count_saves(layer):
    """Within: the row counts of every ``SavedGateUp`` the layer's fused forward allocates (what
    a training call keeps for its backward)."""
    launcher = layer.fused()
    made = []
    allocate = launcher._saved_gate_up

    def recorded(n, *args):
        made.append(n)
        return allocate(n, *args)

    launcher._saved_gate_up = recorded
    try:
        yield made
    finally:
        del launcher._saved_gate_up


def check_cases(rank, world, items, **fused_options):
    for case, skew in items:
        check_case(rank, world, case, skew, **fused_options)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_backward_matches_reference(world):
    """Both routers, with and without shared experts; uneven token counts, a rank with none."""
    run_world(world, check_cases, [(case, "none") for case in CASES], env=INTERPRET)


def test_edge_shapes():
    """Forward, backward and a no-grad call at the shapes of fused_cases.EDGE_CASES, world 1."""
    run_world(1, check_cases, [(case, "none") for case in EDGE_CASES], env=INTERPRET)


@pytest.mark.parametrize("world", [2, 4])
def test_backward_skewed_routing(world):
    """Every token's first choice one expert; every choice on the last rank's experts."""
    items = {
        2: [("softmax", "one_expert"), ("sigmoid_group", "one_expert"), ("sigmoid_group_shared", "one_rank"),
            ("softmax_shared", "one_rank")],
        4: [("softmax_shared", "one_rank")],  # two local experts per rank, top_k 2
    }[world]
    run_world(world, check_cases, items, env=INTERPRET)


def check_full_capacity(rank, world, case):
    """Every rank sends ``max_tokens_per_rank`` tokens and every choice lands on the last rank's
    experts: that rank receives the workspace's documented worst case, ``W T min(K, E/W)`` rows."""
    spec = CASES[case]
    top_k, experts = spec["shape"]["top_k"], spec["shape"]["num_experts"]
    full = max(spec["counts"])
    fused = check_case(rank, world, case, "one_rank", counts=[full] * world, max_tokens=full)
    assert fused.fused().layout.recv_rows == world * full * min(top_k, experts // world)


@pytest.mark.parametrize("world", [2, 4])
def test_full_capacity(world):
    run_world(world, check_full_capacity, "softmax_shared", env=INTERPRET)


def check_peer_skips_backward(rank, world):
    from kosmos_moe.fused import ExpertLayerTimeout

    torch.manual_seed(0)
    layer = ExpertLayer(16, 16, 4, 2, backend="kosmos", group=dist.group.WORLD, max_tokens_per_rank=8)
    x = torch.randn(5, 16, requires_grad=True)
    out = layer(x)
    if rank == 1:
        return  # its forward ran; its backward never launches
    layer.fused().backward.wait_bound = 30
    with pytest.raises(ExpertLayerTimeout, match="backward on rank 0 of 2 .*count-exchange signal of rank 1"):
        out.backward(torch.ones_like(out))
    with pytest.raises(ExpertLayerTimeout):  # a failed world stays failed, for either direction
        with torch.no_grad():
            layer(x)


def test_backward_timeout_names_rank_and_signal():
    """The backward's waits are bounded as the forward's: a peer that never launches its
    backward makes this rank's raise an error naming that peer, not hang."""
    run_world(2, check_peer_skips_backward, env=INTERPRET)


def check_grad_mode_without_trainable(rank, world, case):
    """In grad mode, a call where neither the input nor any parameter needs a gradient keeps
    nothing, as under no_grad; one whose input does keeps the projections of its rows."""
    spec = CASES[case]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    x = tokens(counts, spec["shape"]["hidden_size"], seed=11, positive=False)[rank]
    for p in fused.parameters():
        p.requires_grad_(False)
    with count_saves(fused) as saves:
        out = fused(x)
        assert out.grad_fn is None and saves == []
        out = fused(x.clone().requires_grad_(True))
        assert out.grad_fn is not None and saves == [len(x)]


def test_grad_mode_without_trainable_saves_nothing():
    run_world(1, check_grad_mode_without_trainable, "softmax_shared", env=INTERPRET)


def check_rehearsal_covers_the_step(rank, world, items):
    """Every product a rank's fused training step runs outside its kernels is one the emulated
    world's rehearsal (the reference layer on the rank's tokens) ran at the same shapes."""
    from kosmos_moe.fabric import EmulatedWorld
    from product_ops import ProductOps

    recorded = 0
    for case, skew in items:
        spec = ALL_CASES[case]
        counts = spec["counts"][:world]
        xs = tokens(counts, spec["shape"]["hidden_size"], seed=2, positive=skew != "none")
        gs = cotangents(counts, spec["shape"]["hidden_size"], seed=2)
        full, fused = build(world, case, skew, max_tokens=max(counts) + 3)
        with ProductOps() as rehearsal:
            EmulatedWorld(1, "cpu").rehearse(full, [xs[rank]], [gs[rank]])
        with ProductOps() as step:
            fused_pass(fused, xs[rank], gs[rank])
        missing = sorted(step.seen - rehearsal.seen, key=str)
        assert not missing, f"{case} world {world} rank {rank}: products the rehearsal did not run: {missing}"
        recorded += len(step.seen)
    assert recorded, "no product recorded on any fused step: the probe is broken"


def test_rehearsal_covers_the_fused_step():
    """In an emulated world on one GPU, the host may run only GEMMs the rehearsal ran while the
    peers' kernels wait (kosmos_moe.fabric.EmulatedWorld): the shared experts' backward runs
    between a rank's launches. Both routers, with and without shared experts, a world of 2."""
    run_world(2, check_rehearsal_covers_the_step, [(case, "none") for case in CASES], env=INTERPRET)


def check_gemm_operands(rank, world, items, tma, block_loops):
    import dataclasses

    from kosmos_moe.workspace import INTERPRETER_BACKWARD_TILES

    # The flat-strip run also splits the SwiGLU-backward epilogue in halves, not quarters.
    tiles = dataclasses.replace(INTERPRETER_BACKWARD_TILES, wgrad_tma=tma, tile_tma=tma,
                                wgrad_block_loops=block_loops, swiglu_epilogue_cols=8 if block_loops else 16)
    check_cases(rank, world, items, backward_tiles=tiles)
    _, fused = build(world, items[0][0], "none", max_tokens=8, backward_tiles=tiles)
    launch = fused.fused().backward
    launch.prepare(torch.float32)
    consts = launch._common_constexprs(torch.float32)  # what each launch passes
    assert consts["WG_TMA"] is tma and consts["TILE_TMA"] is tma and consts["PROXY_FENCE"] is False


@pytest.mark.parametrize("tma, block_loops", [(False, False), (True, True)],
                         ids=["pointer_operands_flat_strips", "tma_operands"])
def test_backward_gemm_operands(tma, block_loops):
    """The backward's GEMM operands by pointer loads (pre-Hopper GPUs, unaligned widths) and by
    TMA (the default here: the interpreter emulates it); the one_rank skew leaves the first
    rank's experts without rows, whose weight gradients must be zeros. The pointer run also
    reduces each weight-gradient strip in one flat loop (wgrad_block_loops off) and runs the
    SwiGLU-backward epilogue in column halves (swiglu_epilogue_cols), the defaults until stop 34."""
    run_world(2, check_gemm_operands, [("softmax_shared", "one_rank")], tma, block_loops, env=INTERPRET)


def check_kept_rows(rank, world, items, save_gate_up, save_shared):
    from kosmos_moe.fused import SAVED_NONE, SAVED_SOME

    check_cases(rank, world, items, save_gate_up=save_gate_up, save_shared=save_shared)
    _, fused = build(world, items[0][0], "none", max_tokens=8, save_gate_up=save_gate_up,
                     save_shared=save_shared)
    assert fused.fused().backward.saved == (SAVED_NONE if save_gate_up == 0 else SAVED_SOME)


@pytest.mark.parametrize("world, save_gate_up, save_shared", [(1, 0.0, False), (2, 0.0, False), (2, 0.3, True)])
def test_backward_kept_rows(world, save_gate_up, save_shared):
    """The forward keeps no gate/up projections (every SwiGLU-backward tile redoes them, and
    the shared experts' backward redoes their forward under autograd), or those of 0.3 T K
    rows of a rank's T tokens: row tiles below the cap read them, the others redo them, in one
    launch. The other tests run the defaults: every row kept with one rank, 1.25 T K rows with
    more (the one_rank skew sends the last rank more than that), the shared experts' kept."""
    items = [("softmax_shared", "none"), ("sigmoid_group", "none"), ("softmax", "one_expert")]
    run_world(world, check_kept_rows, items, save_gate_up, save_shared, env=INTERPRET)


# ---------------------------------------------------------------------------------------------
# Training patterns: several calls before or between backwards.

def check_pattern(rank, world, case, pattern):
    """Two batches through one layer; ``.grad`` must end as the sum of both batches' reference grads.

    ``accumulate``: forward, backward, forward, backward. ``interleaved``: both forwards, then
    the first's backward, then the second's; ``interleaved_reversed``: the second's first.
    The second batch has the counts reversed (a different rank is empty) and other tokens.
    """
    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = [spec["counts"][:world], spec["counts"][:world][::-1]]
    full, fused = build(world, case, "none", max_tokens=max(counts[0]) + 3)
    what = f"{case} world {world} {pattern}"
    batches = [(tokens(c, hidden, seed=b + 1, positive=False), cotangents(c, hidden, seed=b + 1))
               for b, c in enumerate(counts)]
    xs = [x[rank].clone().requires_grad_(True) for x, _ in batches]
    gs = [g[rank] for _, g in batches]

    if pattern == "accumulate":
        outs = []
        for x, g in zip(xs, gs):
            outs.append(fused(x))
            (outs[-1] * g).sum().backward()
    else:
        outs = [fused(x) for x in xs]
        order = [0, 1] if pattern == "interleaved" else [1, 0]
        for b in order:
            assert outs[b].grad_fn is not None
            (outs[b] * gs[b]).sum().backward()

    full_grads, own_grads = None, None
    for b, (all_x, all_g) in enumerate(batches):
        ref_out, ref_x_grad, full_b = reference_pass(full, all_x, all_g)
        _, _, own_b = reference_pass(full, [all_x[rank]], [all_g[rank]])
        full_grads = full_b if full_grads is None else add_grads(full_grads, full_b)
        own_grads = own_b if own_grads is None else add_grads(own_grads, own_b)
        start, n = starts(counts[b])[rank], counts[b][rank]
        atol = OUT_ATOL * max(1.0, ref_out.abs().max().item())
        torch.testing.assert_close(outs[b].detach(), ref_out[start:start + n], rtol=OUT_RTOL, atol=atol,
                                   msg=lambda m: f"{what} rank {rank} batch {b} output: {m}")
        assert_grad_close(xs[b].grad, ref_x_grad[start:start + n], f"{what} rank {rank} batch {b}: x.grad")
    check_param_grads(rank, world, fused, full_grads, own_grads, what)


def check_input_without_grad(rank, world, case):
    """Parameters only (a first layer whose input needs no gradient); input with leading dims [1, T, H]."""
    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    full, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    xs = tokens(counts, hidden, seed=3, positive=False)
    gs = cotangents(counts, hidden, seed=3)
    out = fused(xs[rank].unsqueeze(0))
    assert out.shape == (1, counts[rank], hidden) and out.grad_fn is not None
    out.backward(gs[rank].unsqueeze(0))
    _, _, full_grads = reference_pass(full, xs, gs)
    _, _, own_grads = reference_pass(full, [xs[rank]], [gs[rank]])
    check_param_grads(rank, world, fused, full_grads, own_grads, f"{case} world {world} input without grad")


def check_patterns(rank, world, case, patterns):
    for pattern in patterns:
        if pattern == "input_without_grad":
            check_input_without_grad(rank, world, case)
        else:
            check_pattern(rank, world, case, pattern)


@pytest.mark.parametrize("world, patterns", [
    # World 1 (the one-rank fabric) runs the hardest pattern only: the rest is the same at any world.
    pytest.param(1, ["interleaved_reversed"], id="1"),
    pytest.param(2, ["accumulate", "interleaved", "interleaved_reversed", "input_without_grad"], id="2"),
])
def test_accumulation_and_interleaved_backwards(world, patterns):
    """sigmoid_group routing with a shared expert and a correction bias; at world 2 rank 1 has no
    tokens in the first batch and rank 0 none in the second."""
    run_world(world, check_patterns, "sigmoid_group_shared", patterns, env=INTERPRET)


def record_backward_launches(layer, note):
    """Call ``note()`` at every fused backward launch of ``layer``, then launch."""
    launcher = layer.fused()
    backward = launcher.backward

    class Recorded:
        def __getattr__(self, name):
            return getattr(backward, name)

        def __call__(self, *args):
            note()
            return backward(*args)

    launcher.backward = Recorded()


def check_backward_order(rank, world, case):
    """The fused backward is queued before every other backward kernel of the layer."""
    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    fused.compute_aux_loss = True
    order = []
    record_backward_launches(fused, lambda: order.append("fused"))
    gate_forward = fused.gate.forward

    def recorded_gate(x):
        routing = gate_forward(x)
        if routing.scores.requires_grad:  # the auxiliary loss's backward reaches the scores first
            routing.scores.register_hook(lambda g: order.append("aux"))
        return routing

    fused.gate.forward = recorded_gate
    for name, p in fused.named_parameters():
        if name.startswith("shared_experts"):
            p.register_hook(lambda g, name=name: order.append(name))
    x = tokens(counts, hidden, seed=5, positive=False)[rank].requires_grad_(True)
    g = cotangents(counts, hidden, seed=5)[rank]
    out = fused(x)
    ((out * g).sum() + fused.aux_loss).backward()
    shared = {name for name, _ in fused.named_parameters() if name.startswith("shared_experts")}
    assert order[0] == "fused" and set(order[1:]) == shared | {"aux"}, f"rank {rank}: backward order {order}"


def test_fused_backward_runs_first():
    """In an emulated world on one GPU a rank's cuBLAS kernels queued before its persistent
    launch stalled the world (see FusedExpertsFunction): the shared experts' and the auxiliary
    loss's backward must come after the fused one."""
    run_world(2, check_backward_order, "softmax_shared", env=INTERPRET)


def check_saved_bytes(rank, world, case, save_shared):
    """Autograd keeps per token the input row, the int32 choices and fp32 weights, and the
    shared experts' gate and up projections (``2 I_s`` values) unless ``save_shared`` is off
    (then they are recomputed in the backward). Of the routed experts it keeps gate and up
    projections (``2 I`` values a row): with one rank one row per choice and an int32 slot per
    choice; with W ranks ``ceil(1.25 T K)`` rows (at most what the rank can receive) and a slot
    per (source, token, choice) of every rank's largest batch."""
    import math

    from kosmos_moe.activation_memory import saved_bytes

    spec = CASES[case]
    hidden, top_k = spec["shape"]["hidden_size"], spec["shape"]["top_k"]
    inter, experts = spec["shape"]["moe_intermediate_size"], spec["shape"]["num_experts"]
    shared_inter = inter * spec["shape"].get("num_shared_experts", 0)
    assert shared_inter > 0, "the case must have shared experts"
    counts = spec["counts"][:world]
    max_tokens = max(counts) + 3
    _, fused = build(world, case, "none", max_tokens=max_tokens, save_shared=save_shared)
    x = tokens(counts, hidden, seed=7, positive=False)[rank].requires_grad_(True)
    got = saved_bytes(lambda: fused(x), fused)
    n, es = counts[rank], x.element_size()
    if world == 1:
        rows, slots = n * top_k, n * top_k
    else:
        rows = min(world * max_tokens * min(top_k, experts // world), math.ceil(1.25 * n * top_k))
        slots = world * max_tokens * top_k
    expected = (n * (hidden * es + 8 * top_k) + max(n, 1) * 4 * experts + max(rows, 1) * 2 * inter * es
                + max(slots, 1) * 4)
    if save_shared:
        expected += n * 2 * shared_inter * es
    assert got == expected, (f"rank {rank} of {world}, save_shared={save_shared}: {got} bytes saved for {n} tokens, "
                             f"expected {expected}")


@pytest.mark.parametrize("world, save_shared", [(1, True), (2, True), (1, False)])
def test_saved_bytes_per_token(world, save_shared):
    run_world(world, check_saved_bytes, "softmax_shared", save_shared, env=INTERPRET)


def check_kept_logits(rank, world, case):
    """A training forward's route tiles keep the fp32 router logits of this rank's tokens,
    which the backward reads instead of redoing the router GEMM. A backward handed none, or
    logits of another shape, is refused as a call with too many tokens is: after the first
    call's collectives, and in a world of several ranks the layer stays failed."""
    from kosmos_moe import ExpertLayerTimeout
    from kosmos_moe.fused import SavedGateUp

    spec = CASES[case]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    x = tokens(counts, spec["shape"]["hidden_size"], seed=5, positive=False)[rank]
    launcher = fused.fused()
    out, _, top_e, top_w, saved = launcher(x, fused, keep_routing=True)
    assert saved.logits.dtype == torch.float32
    torch.testing.assert_close(saved.logits, x @ fused.gate.weight.float().T, rtol=1e-5, atol=1e-5)
    weights = (fused.gate.weight, fused.experts.gate_up_proj, fused.experts.down_proj)
    g = torch.ones_like(out)

    def backward(logits):
        return launcher.backward(x, g, top_e, top_w,
                                 SavedGateUp(saved.values, saved.slots, saved.rows, logits=logits), *weights)

    with pytest.raises(ValueError, match="router logits"):
        backward(None)
    if world == 1:
        with pytest.raises(ValueError, match="router logits"):
            backward(saved.logits[:, 1:])
        backward(saved.logits)  # one rank only refuses the call
    else:
        with pytest.raises(ExpertLayerTimeout, match="refused a backward call"):
            backward(saved.logits)


@pytest.mark.parametrize("world", [1, 2])
def test_training_forward_keeps_router_logits(world):
    run_world(world, check_kept_logits, "sigmoid_group", env=INTERPRET)


def check_only_shared_trains(rank, world, case):
    """Router and routed experts frozen, input without grad: the shared experts get their
    gradients (this rank's tokens) and no fused backward is launched."""
    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    full, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    for p in (fused.gate.weight, fused.experts.gate_up_proj, fused.experts.down_proj):
        p.requires_grad_(False)
    launches = []
    record_backward_launches(fused, lambda: launches.append(1))
    xs = tokens(counts, hidden, seed=9, positive=False)
    gs = cotangents(counts, hidden, seed=9)
    out = fused(xs[rank])
    assert out.grad_fn is not None
    out.backward(gs[rank])
    assert not launches, f"rank {rank}: the fused backward ran with nothing routed to train"
    _, _, own_grads = reference_pass(full, [xs[rank]], [gs[rank]])
    for name, p in fused.named_parameters():
        if name.startswith("shared_experts"):
            assert_grad_close(p.grad, own_grads[name], f"rank {rank}: {name}")
        else:
            assert p.grad is None, f"rank {rank}: frozen {name} got a gradient"


def test_only_shared_experts_train():
    run_world(2, check_only_shared_trains, "softmax_shared", env=INTERPRET)


def test_triton_allocator_set_only_when_missing():
    """The backward's device-made descriptors need Triton's scratch allocator: the launcher
    supplies one where none is set (autograd's device thread starts with none) and leaves a
    caller's own alone. Run in a copy of the context, so no other test sees either."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    from kosmos_moe.fused import _torch_scratch, ensure_triton_allocator

    def body():
        triton.set_allocator(_allocation.NullAllocator())
        ensure_triton_allocator()
        assert _allocation._allocator.get() is _torch_scratch

        def callers_own(size, alignment, stream):
            raise AssertionError("not called here")

        triton.set_allocator(callers_own)
        ensure_triton_allocator()
        assert _allocation._allocator.get() is callers_own

    contextvars.copy_context().run(body)


def check_compiled_block(rank, world, case):
    """A block of linear -> fused layer -> linear under torch.compile (AOT autograd) computes,
    forward and backward, exactly what it computes eagerly: the fused call runs eagerly
    between the compiled regions (``ExpertLayer._kosmos_forward`` is opaque to Dynamo)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    torch.manual_seed(1)
    block = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), fused, torch.nn.Linear(hidden, hidden))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter)
    for call, n in enumerate((counts[rank], max(counts[rank] - 5, 0))):
        x = tokens([n] * world, hidden, seed=20 + call, positive=False)[rank]
        g = cotangents([n] * world, hidden, seed=20 + call)[rank]
        results = []
        for run in (block, compiled):
            block.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            out = run(xr)
            out.backward(g)
            results.append((out.detach(), xr.grad, {k: p.grad.clone() for k, p in block.named_parameters()
                                                    if p.grad is not None}))
        (out_e, dx_e, grads_e), (out_c, dx_c, grads_c) = results
        what = f"rank {rank}, call {call} ({n} tokens)"
        assert torch.equal(out_c, out_e), what
        assert torch.equal(dx_c, dx_e), what
        assert grads_c.keys() == grads_e.keys(), what
        for k in grads_e:
            assert torch.equal(grads_c[k], grads_e[k]), f"{what}: {k}"
        with torch.no_grad():
            assert torch.equal(compiled(x), block(x)), f"{what}: no-grad call"
    assert counter.frame_count >= 1, "nothing was compiled: the test would not see a tracing failure"


def test_torch_compile_around_the_fused_layer():
    run_world(2, check_compiled_block, "softmax_shared", env=INTERPRET)


def check_checkpointed_block(rank, world, case, use_reentrant):
    """A block of linear -> fused layer -> linear under activation checkpointing: the fused
    forward runs again inside the backward (on every rank, so the recomputed launches pair
    up), the gradients equal those without checkpointing bitwise, and the recompute does not
    count its tokens a second time in the load the bias update reads."""
    from torch.utils.checkpoint import checkpoint

    spec = CASES[case]
    hidden, top_k = spec["shape"]["hidden_size"], spec["shape"]["top_k"]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    torch.manual_seed(1)
    block = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), fused, torch.nn.Linear(hidden, hidden))
    x = tokens(counts, hidden, seed=30, positive=False)[rank]
    g = cotangents(counts, hidden, seed=30)[rank]
    launches = []
    record_backward_launches(fused, lambda: launches.append(1))
    results = []
    for ac in (False, True):
        block.zero_grad(set_to_none=True)
        fused.load_since_bias_update.zero_()
        xr = x.clone().requires_grad_(True)
        out = checkpoint(block, xr, use_reentrant=use_reentrant) if ac else block(xr)
        out.backward(g)
        results.append((out.detach(), xr.grad, {k: p.grad for k, p in block.named_parameters() if p.grad is not None}))
        what = f"rank {rank}, checkpointed={ac}"
        assert int(fused.load_since_bias_update.sum()) == counts[rank] * top_k, what
    assert len(launches) == 2, f"rank {rank}: {len(launches)} fused backward launches for 2 backwards"
    (out_e, dx_e, grads_e), (out_c, dx_c, grads_c) = results
    assert torch.equal(out_c, out_e) and torch.equal(dx_c, dx_e), f"rank {rank}"
    assert grads_c.keys() == grads_e.keys()
    for k in grads_e:
        assert torch.equal(grads_c[k], grads_e[k]), f"rank {rank}: {k}"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_around_the_fused_layer(use_reentrant):
    run_world(2, check_checkpointed_block, "softmax_shared", use_reentrant, env=INTERPRET)


def check_autocast(rank, world, case, save_shared):
    """An fp32 fused layer under torch.autocast computes what its copy in autocast's dtype
    (with the fp32 router weight) computes, bitwise, and its fp32 parameters get that copy's
    gradients. fp16: the interpreter's dots are exact there, not in bf16."""
    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    layers = [build(world, case, "none", max_tokens=max(counts) + 3, dtype=dtype, save_shared=save_shared)[1]
              for dtype in (torch.float32, torch.float16)]
    layers[1].gate.float()  # the copy keeps the fp32 router weight, as the cast layer does
    with torch.no_grad():
        layers[1].gate.weight.copy_(layers[0].gate.weight)
    x = tokens(counts, hidden, seed=40, positive=False)[rank]
    g = cotangents(counts, hidden, seed=40)[rank].half()
    results = []
    for layer, autocast in zip(layers, (True, False)):
        xr = (x if autocast else x.half()).clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = layer(xr)
        out.backward(g)
        results.append((out, xr.grad.half(), layer.tokens_per_expert,
                        {k: p.grad.half() for k, p in layer.named_parameters() if p.grad is not None}))
    (out, dx, load, grads), (out_c, dx_c, load_c, grads_c) = results
    what = f"rank {rank}, save_shared={save_shared}"
    assert out.dtype == torch.float16 and torch.equal(out, out_c), what
    assert torch.equal(dx, dx_c) and torch.equal(load, load_c), what
    assert grads.keys() == grads_c.keys() and len(grads) == len(list(layers[0].parameters())), what
    for k in grads:
        assert layers[0].get_parameter(k).grad.dtype == torch.float32, f"{what}: {k}"
        assert torch.equal(grads[k], grads_c[k]), f"{what}: {k}"


@pytest.mark.parametrize("save_shared", [True, False])
def test_fp32_layer_under_autocast_runs_as_its_copy(save_shared):
    run_world(2, check_autocast, "softmax_shared", save_shared, env=INTERPRET)


def check_deepcopy(rank, world, case):
    """``copy.deepcopy`` of a fused layer after its first calls (as EMA and averaged models
    do): the copy computes what the original computes, in a workspace of its own (the copy
    used to run its kernels through the original's address table while reading its routing
    from its own buffer), shares the process group, and trains apart from the original. A
    layer holding a process group is refused by pickle with a message."""
    import copy
    import io
    import pickle

    spec = CASES[case]
    hidden = spec["shape"]["hidden_size"]
    counts = spec["counts"][:world]
    _, fused = build(world, case, "none", max_tokens=max(counts) + 3)
    xs = tokens(counts, hidden, seed=50, positive=False)
    out = fused(xs[rank])
    twin = copy.deepcopy(fused)
    assert twin.group is fused.group and twin.experts.gate_up_proj is not fused.experts.gate_up_proj
    for call in range(2):
        got = twin(xs[rank])
        assert torch.equal(got, fused(xs[rank])) and torch.equal(got, out), f"rank {rank}, call {call}"
        assert torch.equal(twin.tokens_per_expert, fused.tokens_per_expert), f"rank {rank}, call {call}"
    mine, theirs = twin.fused().workspace, fused.fused().workspace
    assert mine.local.data_ptr() != theirs.local.data_ptr()
    assert not set(mine.peers.tolist()) & set(theirs.peers.tolist()), "the copy runs in the original's workspace"
    with torch.no_grad():
        twin.experts.down_proj.mul_(2.0)
    assert torch.equal(fused(xs[rank]), out), f"rank {rank}: changing the copy changed the original"
    with pytest.raises(pickle.PicklingError, match=r"holds a group \(process-local handles\): save its state_dict"):
        torch.save(fused, io.BytesIO())
    # The reference backend in the same world: its copy shares the group too (a process group
    # cannot be copied; deepcopy used to raise), also after a training call with an auxiliary
    # loss (part of that call's graph, not copied).
    reference = ExpertLayer(**spec["shape"], group=dist.group.WORLD, compute_aux_loss=True)
    reference.load_state_dict(fused.state_dict())
    reference(xs[rank].clone().requires_grad_(True))
    twin = copy.deepcopy(reference)
    assert twin.aux_loss is None and torch.equal(twin(xs[rank]), reference(xs[rank]))
    shallow = copy.copy(fused)  # as for any module: the same parameters and launcher
    assert shallow.fused() is fused.fused() and torch.equal(shallow(xs[rank]), out)


def test_deepcopy_of_a_fused_layer():
    run_world(2, check_deepcopy, "softmax_shared", env=INTERPRET)


def check_pickle_round_trip(rank, world, case):
    import io

    spec = CASES[case]
    _, fused = build(world, case, "none", max_tokens=40)
    x = tokens([21], spec["shape"]["hidden_size"], seed=51, positive=False)[0]
    out = fused(x)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._fused is None and torch.equal(loaded(x), out)


def test_pickle_of_a_fused_layer_without_a_group():
    """torch.save of a whole single-process fused layer (it used to fail on the workspace's
    views): the loaded layer rebuilds its workspace and computes the same."""
    run_world(1, check_pickle_round_trip, "softmax_shared", env=INTERPRET)


def check_autocast_descriptors(rank, world):
    """Weights by TMA (widths of 16-byte multiples in fp16): the descriptors of an fp16
    layer's own weights are cached across calls; those of an fp32 layer's per-call casts under
    autocast are not (a cached one kept the call's copy of the weights alive)."""
    layers = [ExpertLayer(32, 16, 8, 2, backend="kosmos", max_tokens_per_rank=16, dtype=dtype)
              for dtype in (torch.float16, torch.float32)]
    x = torch.randn(9, 32)
    with torch.no_grad():
        layers[0](x.half())
        with torch.autocast("cpu", dtype=torch.float16):
            layers[1](x)
    assert layers[0].fused()._descriptors is not None
    assert layers[1].fused()._descriptors is None


def test_autocast_casts_are_not_kept_by_descriptors():
    run_world(1, check_autocast_descriptors, env=INTERPRET)
