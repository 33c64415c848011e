"""backend='deepep': the layer over a DeepEP-style Buffer, forward and backward, against the reference.

DeepEP itself is not installable here, so the Buffer is kosmos_moe.deepep_compat.Buffer (the
same API); with DeepEP installed, the layer builds a deep_ep.Buffer instead. Without DeepEP,
backend='deepep' with no buffer must refuse with install instructions.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from kosmos_moe import ExpertLayer
from multiprocess import INTERPRET, run_world

SHAPE = dict(hidden_size=24, moe_intermediate_size=20, num_experts=8, top_k=3, router="sigmoid_group", n_group=2,
             topk_group=1, routed_scaling_factor=1.5, num_shared_experts=1)


def check_layer(rank, world, counts):
    from kosmos_moe.deepep_compat import Buffer

    torch.manual_seed(0)
    full = ExpertLayer(**SHAPE)
    full.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    group = dist.group.WORLD if world > 1 else None
    buffer = Buffer(group, int(1e9), max_tokens_per_rank=max(counts) + 1)
    layer = ExpertLayer(**SHAPE, backend="deepep", group=group, deepep_buffer=buffer)
    layer.load_full_state_dict(full.state_dict())
    xs = [torch.randn(n, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(r)) for r, n in enumerate(counts)]
    gs = [torch.randn(n, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(9 + r)) for r, n in enumerate(counts)]
    x = xs[rank].clone().requires_grad_()
    out = layer(x)
    torch.autograd.backward(out, gs[rank])
    x_all = torch.cat(xs).requires_grad_()
    ref = full(x_all)
    torch.autograd.backward(ref, torch.cat(gs))
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    first, last = layer.local_expert_range
    torch.testing.assert_close(out, ref[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_all.grad[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.experts.gate_up_proj.grad, full.experts.gate_up_proj.grad[first:last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.experts.down_proj.grad, full.experts.down_proj.grad[first:last], rtol=1e-5, atol=1e-5)
    router = layer.gate.weight.grad.clone()
    if world > 1:
        dist.all_reduce(router)  # each rank's router gradient covers its own tokens
    torch.testing.assert_close(router, full.gate.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_deepep_backend_matches_reference(world):
    run_world(world, check_layer, [13, 7][:world], env=INTERPRET)


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="DeepEP is installed here")
def test_deepep_backend_without_deepep_says_how_to_install():
    with pytest.raises(ImportError, match="github.com/deepseek-ai/DeepEP"):
        ExpertLayer(**SHAPE, backend="deepep")
