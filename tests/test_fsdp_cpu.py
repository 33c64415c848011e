"""FSDP2 (``fully_shard``) around the layer, in a world of 2 CPU processes (gloo), for the
reference backend and the fused one under Triton's interpreter: the same outputs and input
gradients as the unsharded layer, and its gradients averaged over the ranks."""

import pytest
import torch
import torch.distributed as dist

from multiprocess import INTERPRET, run_world

SHAPE = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, num_shared_experts=1)


def _layers(backend):
    from kosmos_moe import ExpertLayer

    extra = dict(max_tokens_per_rank=64) if backend == "kosmos" else {}
    torch.manual_seed(0)
    plain = ExpertLayer(**SHAPE, backend=backend, **extra)
    sharded = ExpertLayer(**SHAPE, backend=backend, **extra)
    sharded.load_state_dict(plain.state_dict())
    return plain, sharded


def check_fully_sharded_layer(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain, sharded = _layers(backend)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    for call in range(2):  # the second call re-gathers what the first resharded
        x = torch.randn(20 - 3 * call, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(10 * call + rank))
        got = []
        for layer in (plain, sharded):
            layer.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            out = layer(xr)
            out.square().sum().backward()
            got.append((out.detach(), xr.grad))
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"rank {rank}, call {call}"
        for name, p in plain.named_parameters():
            dist.all_reduce(p.grad)
            expected = p.grad / world
            torch.testing.assert_close(sharded.get_parameter(name).grad.full_tensor(), expected, rtol=1e-6,
                                       atol=1e-7, msg=f"rank {rank}, call {call}: {name}")


@pytest.mark.parametrize("backend", ["reference", "kosmos"])
def test_fully_shard_around_the_layer(backend):
    run_world(2, check_fully_sharded_layer, backend, env=INTERPRET)


def check_sharded_submodule_is_refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, sharded = _layers("kosmos")
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(sharded.experts, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"experts.gate_up_proj, experts.down_proj still sharded .*fully_shard\(layer\)"):
        sharded(torch.randn(5, SHAPE["hidden_size"]))


def test_fused_layer_refuses_sharded_submodules():
    """The kernels read the submodules' parameters without calling them: FSDP2 on the experts
    alone would leave them sharded. It used to end in a freed-storage error on one rank."""
    run_world(2, check_sharded_submodule_is_refused, env=INTERPRET)
