"""The reference ExpertLayer on one rank against the independent per-token oracle."""

from dataclasses import asdict

import pytest
import torch

from kosmos_moe import ExpertLayer
from oracle import oracle_forward

# Shapes deliberately not powers of two.
CASES = {
    "softmax": dict(hidden_size=48, moe_intermediate_size=40, num_experts=6, top_k=3, router="softmax"),
    "softmax_no_renorm": dict(
        hidden_size=36, moe_intermediate_size=20, num_experts=5, top_k=2, router="softmax", norm_topk_prob=False
    ),
    "sigmoid_group": dict(
        hidden_size=40, moe_intermediate_size=24, num_experts=12, top_k=3, router="sigmoid_group",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=2,
    ),
}


def build(case: str, **extra) -> ExpertLayer:
    torch.manual_seed(0)
    layer = ExpertLayer(**CASES[case], dtype=torch.float64, **extra)
    if layer.gate.e_score_correction_bias is not None:
        layer.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    return layer


def oracle_config(layer: ExpertLayer) -> dict:
    return asdict(layer.config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_per_token_oracle_forward_and_backward(case):
    layer = build(case)
    x = torch.randn(2, 13, layer.config.hidden_size, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn_like(x)

    out = layer(x)
    assert out.shape == x.shape
    (out * cotangent).sum().backward()

    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    params.update({n: b for n, b in layer.named_buffers() if n == "gate.e_score_correction_bias"})
    x_ref = x.detach().clone().requires_grad_(True)
    ref = oracle_forward(x_ref.reshape(-1, x.shape[-1]), params, oracle_config(layer)).reshape(x.shape)
    (ref * cotangent).sum().backward()

    # The router computes in fp32 by design; the oracle in fp64.
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, **tol, msg=lambda m: f"{name}: {m}")


def test_parameter_layout_is_hugging_face_v5():
    layer = build("sigmoid_group")
    shapes = {n: tuple(t.shape) for n, t in layer.state_dict().items()}
    assert shapes == {
        "gate.weight": (12, 40),
        "gate.e_score_correction_bias": (12,),
        "experts.gate_up_proj": (12, 48, 40),
        "experts.down_proj": (12, 40, 24),
        "shared_experts.gate_proj.weight": (48, 40),
        "shared_experts.up_proj.weight": (48, 40),
        "shared_experts.down_proj.weight": (40, 48),
    }
    assert "gate.e_score_correction_bias" not in dict(layer.named_parameters())
    assert "gate.e_score_correction_bias" not in build("softmax").state_dict()


def test_gate_rows_come_first_in_gate_up_proj():
    # One expert per token, written out by hand: down (silu(gate x) * up x), gate the first I
    # rows of gate_up_proj. The halves' other order gives another function, so a layer that
    # read them swapped fails here (zeroing one half would not tell them apart: silu(0) = 0).
    torch.manual_seed(0)
    layer = ExpertLayer(48, 40, 6, 1, norm_topk_prob=True, dtype=torch.float64)
    inter = layer.config.moe_intermediate_size
    x = torch.randn(11, 48, dtype=torch.float64)
    out = layer(x)
    experts = layer.gate(x).experts[:, 0]
    w = layer.experts.gate_up_proj.detach()[experts]  # [tokens, 2I, H]
    down = layer.experts.down_proj.detach()[experts]  # [tokens, H, I]
    gate, up = torch.einsum("tih,th->ti", w[:, :inter], x), torch.einsum("tih,th->ti", w[:, inter:], x)

    def expert(a, b):
        return torch.einsum("thi,ti->th", down, torch.nn.functional.silu(a) * b)

    torch.testing.assert_close(out.detach(), expert(gate, up))
    assert not torch.allclose(expert(up, gate), expert(gate, up), rtol=1e-3, atol=1e-3)


def test_empty_batch_forward_and_backward():
    layer = build("sigmoid_group")
    x = torch.zeros(0, 40, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 40)
    out.sum().backward()
    assert x.grad.shape == (0, 40)
    assert int(layer.tokens_per_expert.sum()) == 0


def test_all_tokens_to_one_expert():
    layer = build("softmax", compute_aux_loss=True)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[4] = 1.0
    x = torch.rand(9, 48, dtype=torch.float64) + 0.5  # positive => expert 4 dominates
    layer_top1 = ExpertLayer(48, 40, 6, 1, dtype=torch.float64)
    layer_top1.load_state_dict(layer.state_dict())
    out = layer_top1(x)
    assert layer_top1.tokens_per_expert.tolist() == [0, 0, 0, 0, 9, 0]
    ref = oracle_forward(x, dict(layer_top1.named_parameters()), oracle_config(layer_top1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", ["softmax", "sigmoid_group"])
def test_torch_compile_matches_eager(router):
    """The reference backend under torch.compile (Dynamo + AOT autograd): the same output,
    input and parameter gradients, routing statistics and auxiliary loss as eagerly."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = build(router, compute_aux_loss=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)
    x = torch.randn(30, layer.config.hidden_size, dtype=torch.float64)
    results = []
    for run in (layer, compiled):
        layer.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        out = run(xr)
        (out.square().sum() + layer.aux_loss).backward()
        results.append((out.detach(), xr.grad, layer.tokens_per_expert.clone(), layer.aux_loss.detach(),
                        {k: p.grad for k, p in layer.named_parameters()}))
    for eager, comp in zip(*results):
        if isinstance(eager, dict):
            for k in eager:
                torch.testing.assert_close(comp[k], eager[k], rtol=1e-12, atol=1e-12, msg=k)
        else:
            torch.testing.assert_close(comp, eager, rtol=1e-12, atol=1e-12)
    assert counter.frame_count >= 1


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_the_load_once(use_reentrant):
    """Checkpointing reruns the forward inside the backward: same gradients, and the load the
    bias update reads counts each call's tokens once."""
    from torch.utils.checkpoint import checkpoint

    layer = build("sigmoid_group")
    x = torch.randn(30, layer.config.hidden_size, dtype=torch.float64)
    grads = []
    for ac in (False, True):
        layer.zero_grad(set_to_none=True)
        layer.load_since_bias_update.zero_()
        xr = x.clone().requires_grad_(True)
        out = checkpoint(layer, xr, use_reentrant=use_reentrant) if ac else layer(xr)
        out.square().sum().backward()
        assert int(layer.load_since_bias_update.sum()) == 30 * layer.config.top_k
        grads.append([xr.grad] + [p.grad for p in layer.parameters()])
    for eager, recomputed in zip(*grads):
        assert torch.equal(eager, recomputed)


def test_load_statistics_and_bias_update_through_layer():
    layer = build("sigmoid_group")
    layer.gate.e_score_correction_bias.zero_()
    x = torch.randn(30, 40, dtype=torch.float64)
    layer(x)
    first = layer.tokens_per_expert.clone()
    assert int(first.sum()) == 30 * 3
    layer(x[:10])
    assert int(layer.tokens_per_expert.sum()) == 10 * 3
    load = layer.update_router_bias()
    assert not layer.load_since_bias_update.any()  # the accumulator was reset
    assert int(load.sum()) == 40 * 3
    expected = 1e-3 * torch.sign(load.double().mean() - load.double())
    torch.testing.assert_close(layer.gate.e_score_correction_bias.double(), expected)


def test_bias_update_refused_for_softmax():
    with pytest.raises(RuntimeError, match="sigmoid_group"):
        build("softmax").update_router_bias()


def test_switch_aux_loss_value_and_router_gradient():
    # E sum_e f_e P_e written out: f_e the share of (token, choice) pairs on expert e (no
    # gradient), P_e the mean softmax probability of expert e.
    layer = build("softmax", compute_aux_loss=True)
    x = torch.randn(20, 48, dtype=torch.float64)
    layer(x)
    layer.aux_loss.backward()
    weight = layer.gate.weight.detach().clone().requires_grad_(True)
    probs = torch.softmax(x.float() @ weight.float().t(), dim=-1)  # the router's fp32 scores
    chosen = probs.detach().topk(layer.config.top_k, dim=-1).indices
    share = torch.bincount(chosen.flatten(), minlength=6).double() / chosen.numel()
    expected = 6 * (share * probs.double().mean(0)).sum()
    expected.backward()
    torch.testing.assert_close(layer.aux_loss.detach().double(), expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.gate.weight.grad, weight.grad, rtol=1e-5, atol=1e-7)
    assert weight.grad.abs().max() > 1e-4  # a gradient that says something


def test_presets_have_the_production_shapes():
    ds = ExpertLayer.deepseek_v3(device="meta")
    assert ds.experts.gate_up_proj.shape == (256, 4096, 7168)
    assert ds.experts.down_proj.shape == (256, 7168, 2048)
    assert ds.shared_experts.gate_proj.weight.shape == (2048, 7168)
    c = ds.config
    assert (c.router, c.top_k, c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob) == (
        "sigmoid_group", 8, 8, 4, 2.5, True
    )
    qw = ExpertLayer.qwen3_235b(device="meta")
    assert qw.experts.gate_up_proj.shape == (128, 3072, 4096)
    assert qw.shared_experts is None and qw.config.router == "softmax" and qw.config.top_k == 8
    small = ExpertLayer.qwen3_235b(hidden_size=64, num_experts=16, device="meta")
    assert small.experts.gate_up_proj.shape == (16, 3072, 64)


# --- bad input ------------------------------------------------------------------------------


def test_wrong_hidden_size():
    with pytest.raises(ValueError, match="hidden_size=48"):
        build("softmax")(torch.randn(3, 47, dtype=torch.float64))


def test_wrong_dtype():
    with pytest.raises(TypeError, match="float32.*float64"):
        build("softmax")(torch.randn(3, 48, dtype=torch.float32))


def test_autocast_does_not_change_the_layer():
    """Under torch.autocast a layer in another dtype than fp32 computes as without it, in its
    parameters' dtype (the router and the fold in fp32): the same output, gradients and
    auxiliary loss, bitwise. Autocast used to run the router's linear, the fold and the shared
    experts in bf16."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float64):  # fp32 layers: the next test
        layer = ExpertLayer(48, 40, 6, 2, num_shared_experts=1, compute_aux_loss=True, dtype=dtype)
        x = torch.randn(50, 48, dtype=dtype)
        results = []
        for autocast in (False, True):
            layer.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = layer(xr)
                loss = out.float().square().sum() + layer.aux_loss
            loss.backward()
            results.append([out, xr.grad, layer.aux_loss, *(p.grad for p in layer.parameters())])
        for plain, cast in zip(*results):
            assert plain.dtype == cast.dtype and torch.equal(plain, cast), dtype


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_fp32_layer_under_autocast_runs_as_its_bf16_copy(input_dtype):
    """An fp32 layer under torch.autocast(bf16) computes what its bf16 copy (with the fp32
    router weight) computes, bitwise (output, input gradient, auxiliary loss, routing
    statistics), and its fp32 parameters get the copy's gradients (as autocast does for
    nn.Linear: gradients through the casts)."""
    torch.manual_seed(0)
    layer = ExpertLayer(48, 40, 6, 2, router="sigmoid_group", n_group=2, topk_group=1, num_shared_experts=1,
                        compute_aux_loss=True)
    copy = ExpertLayer(48, 40, 6, 2, router="sigmoid_group", n_group=2, topk_group=1, num_shared_experts=1,
                       compute_aux_loss=True, dtype=torch.bfloat16)
    copy.gate.float()  # the router keeps its fp32 weight
    with torch.no_grad():
        layer.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    copy.load_state_dict(layer.state_dict())
    x = torch.randn(50, 48)
    xa = x.to(input_dtype).clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(xa)
        loss = out.float().square().sum() + layer.aux_loss
    loss.backward()  # outside autocast, as PyTorch's docs ask
    xc = x.to(torch.bfloat16).requires_grad_(True)
    out_c = copy(xc)
    (out_c.float().square().sum() + copy.aux_loss).backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_c)
    assert torch.equal(layer.aux_loss, copy.aux_loss)
    assert xa.grad.dtype == input_dtype and torch.equal(xa.grad.to(torch.bfloat16), xc.grad)
    assert torch.equal(layer.tokens_per_expert, copy.tokens_per_expert)
    for (name, p), q in zip(layer.named_parameters(), copy.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad.to(q.dtype), q.grad), name


def test_autocast_runs_the_layer_hooks_once():
    """The fp32 layer's autocast path swaps its parameters for the call instead of calling the
    module again: its hooks (FSDP2's, a user's) run once per call."""
    layer = ExpertLayer(48, 40, 6, 2)
    calls = []
    layer.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    layer.register_forward_hook(lambda m, args, out: calls.append("post"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(5, 48))
    assert calls == ["pre", "post"] and out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in layer.parameters())  # swapped back after the call


def test_fp32_router_beside_lower_precision_experts():
    """A gate kept in fp32 beside bf16 experts (as DeepSeek-V3 checkpoints keep it) takes
    inputs in the experts' dtype; a gate in a third dtype is refused."""
    layer = ExpertLayer(48, 40, 6, 2, dtype=torch.bfloat16)
    layer.gate.float()
    out = layer(torch.randn(5, 48, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dtype torch.float32 but the layer's weights are torch.bfloat16"):
        layer(torch.randn(5, 48))
    layer.gate.half()
    with pytest.raises(TypeError, match="gate's weight is torch.float16, the experts' torch.bfloat16"):
        layer(torch.randn(5, 48, dtype=torch.bfloat16))


def test_integer_input():
    with pytest.raises(TypeError, match="floating-point"):
        build("softmax")(torch.ones(3, 48, dtype=torch.int64))


def test_input_on_another_device_than_weights():
    with pytest.raises(ValueError, match="meta.*cpu"):
        build("softmax")(torch.randn(3, 48, dtype=torch.float64, device="meta"))


def test_top_k_larger_than_num_experts():
    with pytest.raises(ValueError, match="top_k=7 exceeds num_experts=6"):
        ExpertLayer(48, 40, 6, 7)


def test_too_few_experts_survive_group_selection():
    with pytest.raises(ValueError, match=r"topk_group \* \(num_experts / n_group\)"):
        ExpertLayer(48, 40, 16, 5, router="sigmoid_group", n_group=8, topk_group=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(router="mystery"), "router must be one of"),
        (dict(backend="mystery"), "backend must be one of"),
        (dict(router="sigmoid_group", n_group=4), "not divisible by n_group=4"),
        (dict(router="sigmoid_group", n_group=2, topk_group=3), "topk_group=3 exceeds n_group=2"),
        (dict(n_group=2), "only defined for router='sigmoid_group'"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
        (dict(routed_scaling_factor="a"), "routed_scaling_factor must be a positive finite number"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a positive finite number"),
        (dict(norm_topk_prob="no"), "norm_topk_prob must be True or False"),
        (dict(num_shared_experts=1.5), "num_shared_experts must be an int"),
        (dict(workers_per_rank=4), "only used by backend='kosmos'"),
        (dict(fused_options={"profile": True}), "only used by backend='kosmos'"),
        (dict(backend="kosmos", max_tokens_per_rank=8, workers_per_rank=0), "workers_per_rank must be a positive int"),
        (dict(backend="kosmos", max_tokens_per_rank=8, fused_options={"bogus": 1}), r"unknown fused_options \['bogus'\]"),
    ],
)
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertLayer(48, 40, 6, 2, **kwargs)


@pytest.mark.parametrize("hidden", [0, True, 4.0])
def test_sizes_must_be_positive_ints(hidden):
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        ExpertLayer(hidden, 40, 6, 2)


SHARED_GRADIENTS = {"all": "gate up down", "weights": "gate up down", "input": "", "down_only": "down"}


def shared_experts_case(wanted: str, dtype: torch.dtype, seed: int):
    """``(shared, x, g, need_x)``: shared experts whose parameters require grad as ``wanted``
    (a key of SHARED_GRADIENTS) says, 13 tokens and their output gradient."""
    from kosmos_moe.experts import SharedExperts

    torch.manual_seed(seed)
    shared = SharedExperts(36, 20, dtype=dtype)
    x = torch.randn(13, 36, dtype=dtype)
    g = torch.randn(13, 36, dtype=dtype)
    for name, p in shared.named_parameters():
        p.requires_grad_(name.split("_")[0] in SHARED_GRADIENTS[wanted].split())
    return shared, x, g, wanted in ("all", "input")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("wanted", list(SHARED_GRADIENTS))
def test_shared_experts_backward_from_kept_projections(dtype, wanted):
    """The shared experts' backward from their kept projections (the fused backend's path)
    equals autograd's through their forward: the weight gradients bit for bit (the same ops
    on the same projections), the input's to rounding (the order of its additions may differ)."""
    from kosmos_moe.experts import shared_experts_backward

    shared, x, g, need_x = shared_experts_case(wanted, dtype, seed=3)
    dx_routed = torch.randn(13, 36, dtype=dtype)
    params = dict(gate=shared.gate_proj.weight, up=shared.up_proj.weight, down=shared.down_proj.weight)

    xr = x.clone().requires_grad_(need_x)
    shared(xr).backward(g)
    with torch.no_grad():
        gate_up = torch.cat([shared.gate_proj(x), shared.up_proj(x)], dim=-1)
        dx, grads = shared_experts_backward(dict(shared.named_parameters()), x, g, gate_up, dx_routed.clone(), need_x,
                                            {n: p.requires_grad for n, p in shared.named_parameters()})
    for name, p in params.items():
        if p.requires_grad:
            assert torch.equal(grads[f"{name}_proj.weight"], p.grad), f"{name}_proj: differs from autograd"
        else:
            assert f"{name}_proj.weight" not in grads, f"{name}_proj: a gradient nobody asked for"
    if need_x:
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dx, dx_routed + xr.grad, **tol)
    else:
        assert dx is None


@pytest.mark.parametrize("wanted", list(SHARED_GRADIENTS))
def test_shared_experts_backward_runs_only_products_the_module_runs(wanted):
    """Every GEMM of the shared experts' backward is one that the module's own forward and
    autograd backward run, with the same shapes, strides and dtype. In an emulated world a rank's
    backward runs it while its peers' persistent kernels wait for the next rank's launch, and a
    cuBLAS kernel the process has not run yet holds the host until those kernels end: an addmm
    there stalled worlds of 2-8 ranks (kosmos_moe.fabric.EmulatedWorld). The world's rehearsal
    runs the module at each rank's shapes, so only its products are safe there."""
    from kosmos_moe.experts import shared_experts_backward
    from product_ops import ProductOps

    shared, x, g, need_x = shared_experts_case(wanted, torch.bfloat16, seed=5)
    with ProductOps() as module_products:
        shared(x.clone().requires_grad_(need_x)).backward(g)
    with torch.no_grad():
        gate_up = torch.cat([shared.gate_proj(x), shared.up_proj(x)], dim=-1)
    with ProductOps() as fused_products:
        shared_experts_backward(dict(shared.named_parameters()), x, g, gate_up, torch.randn(13, 36, dtype=torch.bfloat16),
                                need_x, {n: p.requires_grad for n, p in shared.named_parameters()})
    assert fused_products.seen, "no product recorded: the probe itself is broken"
    assert fused_products.seen <= module_products.seen, sorted(fused_products.seen - module_products.seen)


def test_numpy_config_values_are_taken_as_python_ones():
    # As a config file read through numpy hands them over.
    np = pytest.importorskip("numpy")
    layer = ExpertLayer(np.int64(48), 40, np.int32(6), 2, routed_scaling_factor=np.float32(2.5),
                        norm_topk_prob=np.bool_(False))
    c = layer.config
    assert (type(c.hidden_size), type(c.num_experts), type(c.routed_scaling_factor), type(c.norm_topk_prob)) == (
        int, int, float, bool)
    assert (c.hidden_size, c.routed_scaling_factor, c.norm_topk_prob) == (48, 2.5, False)
