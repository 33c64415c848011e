"""The fused layer in a training stack on one GPU, bf16: CUDA autocast over an fp32 layer,
layers sharing their workspaces, and torch.compile around the layer, each against the same
computation without it, bitwise (the CPU suites check the same under the interpreter, at
fp16 and fp32: tests/test_fused_backward_cpu.py, tests/test_workspace_sharing_cpu.py)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel's GPU path needs a CUDA device"),
]

# Widths of 16-byte multiples (weights by TMA), no powers of two; 300 tokens of 512.
SHAPE = dict(hidden_size=1032, moe_intermediate_size=392, num_experts=16, top_k=4, num_shared_experts=1)


def fused_layer(dtype, seed=0, **kwargs):
    from kosmos_moe import ExpertLayer

    torch.manual_seed(seed)
    return ExpertLayer(**SHAPE, backend="kosmos", max_tokens_per_rank=512, device="cuda", dtype=dtype, **kwargs)


def forward_backward(module, x, g, autocast_dtype=None, owner=None):
    """Output, input gradient and the parameter gradients of ``owner`` (default ``module``)."""
    xr = x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = module(xr)
    out.backward(g)
    return out.detach(), xr.grad, {k: p.grad for k, p in (owner or module).named_parameters()}


def test_fp32_layer_under_autocast_runs_as_its_bf16_copy():
    layer = fused_layer(torch.float32)
    copy = fused_layer(torch.bfloat16)
    copy.gate.float()  # the autocast path keeps the fp32 router weight
    copy.load_state_dict(layer.state_dict())
    x = torch.randn(300, SHAPE["hidden_size"], device="cuda")
    g = torch.randn(300, SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16)
    out, dx, grads = forward_backward(layer, x, g, autocast_dtype=torch.bfloat16)
    out_c, dx_c, grads_c = forward_backward(copy, x.to(torch.bfloat16), g)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_c)
    assert torch.equal(dx.to(torch.bfloat16), dx_c)
    for k in grads:
        assert grads[k].dtype == torch.float32 and torch.equal(grads[k].to(grads_c[k].dtype), grads_c[k]), k
    assert layer.fused()._descriptors is None  # the call's cast weights were not kept


def test_shared_workspaces_compute_what_separate_ones_do():
    from kosmos_moe import share_workspaces

    def model():
        return torch.nn.Sequential(*[fused_layer(torch.bfloat16, seed=i) for i in range(3)])

    separate, shared = model(), model()
    pool = share_workspaces(shared)
    x = torch.randn(300, SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    results = [forward_backward(m, x, g) for m in (separate, shared)]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for k, grad in results[0][2].items():
        assert torch.equal(grad, results[1][2][k]), k
    assert len(pool) == 2 and len({id(layer.fused().workspace) for layer in shared}) == 1


def test_torch_compile_around_the_layer():
    torch.manual_seed(1)
    block = torch.nn.Sequential(
        torch.nn.Linear(SHAPE["hidden_size"], SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16),
        fused_layer(torch.bfloat16),
        torch.nn.Linear(SHAPE["hidden_size"], SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16),
    )
    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(300, SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    eager = forward_backward(block, x, g)
    block.zero_grad(set_to_none=True)
    got = forward_backward(compiled, x, g, owner=block)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    for k, grad in eager[2].items():
        assert torch.equal(got[2][k], grad), k
