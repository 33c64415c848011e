"""Layers sharing their workspaces (kosmos_moe.share_workspaces), under Triton's interpreter in
worlds of CPU processes: a model of several fused layers computes, forward and backward, what
the same model with a workspace per layer computes, bitwise, in one workspace per direction;
and a call that leaves the shared workspace inconsistent fails every layer using it."""

import pytest
import torch
import torch.distributed as dist

from multiprocess import INTERPRET, run_world

SHAPE = dict(hidden_size=24, moe_intermediate_size=20, num_experts=8, top_k=3, num_shared_experts=1)


def model(world, layers=3, max_tokens=40):
    from kosmos_moe import ExpertLayer

    torch.manual_seed(0)  # every rank builds the same model; each holds its experts
    group = dist.group.WORLD if world > 1 else None
    return torch.nn.Sequential(*[ExpertLayer(**SHAPE, backend="kosmos", group=group, max_tokens_per_rank=max_tokens,
                                             workers_per_rank=2) for _ in range(layers)])


def check_shared_equals_separate(rank, world):
    import kosmos_moe

    separate, shared = model(world), model(world)
    pool = kosmos_moe.share_workspaces(shared)
    counts = [(17, 9), (0, 31)][rank % 2]  # two micro-batches per rank; one rank with none
    results = []
    for m in (separate, shared):
        micro = []
        for i, n in enumerate(counts):  # every micro-batch's forward, then the backwards
            x = torch.randn(n, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(100 * rank + i))
            x.requires_grad_(True)
            micro.append((m(x), x))
        for out, _ in reversed(micro):
            out.square().sum().backward()
        results.append(([o.detach() for o, _ in micro], [x.grad for _, x in micro],
                        [p.grad for p in m.parameters()]))
    for kind, a, b in zip(("outputs", "input gradients", "parameter gradients"), *results):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"rank {rank}: {kind} differ"
    layers = list(shared)
    assert all(layer.fused().workspace is not None and layer.fused().backward.workspace is not None
               for layer in layers)
    assert len(pool) == 2, f"rank {rank}: {len(pool)} workspaces for one layout in two directions"
    assert len({id(layer.fused().workspace) for layer in layers}) == 1
    assert len({id(layer.fused().backward.workspace) for layer in layers}) == 1
    own = sum(layer.fused().workspace.local.numel() + layer.fused().backward.workspace.local.numel()
              for layer in separate)
    assert pool.nbytes * len(layers) == own


@pytest.mark.parametrize("world", [1, 2])
def test_shared_workspaces_compute_what_separate_ones_do(world):
    run_world(world, check_shared_equals_separate, env=INTERPRET)


def check_failure_reaches_every_sharer(rank, world):
    from kosmos_moe import ExpertLayerTimeout, share_workspaces

    m = model(world, layers=4, max_tokens=8)
    share_workspaces(m)
    with torch.no_grad():
        m[:3](torch.randn(5, SHAPE["hidden_size"]))  # layers 0-2 have run once; layer 3 has not
        for layer in m:
            layer.fused().wait_bound = 30
        if rank == 0:
            with pytest.raises(ValueError, match="9 tokens on rank 0"):
                m[1](torch.randn(9, SHAPE["hidden_size"]))
        else:
            with pytest.raises(ExpertLayerTimeout, match="rank 1 of 2"):
                m[1](torch.randn(5, SHAPE["hidden_size"]))
        # The shared forward workspace is inconsistent now: the other layers refuse too, with
        # the error that broke it (rank 0's own layers never failed a call).
        match = "rank 0 of 2 refused a forward call" if rank == 0 else "rank 1 of 2 .*timed out"
        for i in (0, 2, 3):  # layer 3 gets the failed workspace at its first call, and refuses
            with pytest.raises(ExpertLayerTimeout, match=match):
                m[i](torch.randn(5, SHAPE["hidden_size"]))


def test_a_failed_call_fails_every_layer_sharing_its_workspace():
    run_world(2, check_failure_reaches_every_sharer, env=INTERPRET)


def check_sharing_late(rank, world):
    from kosmos_moe import share_workspaces

    m = model(world, layers=1)
    m(torch.randn(3, SHAPE["hidden_size"]))
    with pytest.raises(ValueError, match="has run already and holds its own workspace"):
        share_workspaces(m)


def test_sharing_after_the_first_call_is_refused():
    run_world(1, check_sharing_late, env=INTERPRET)


def check_pickled_model_keeps_sharing(rank, world):
    import io

    from kosmos_moe import share_workspaces

    m = model(world, layers=2)
    pool = share_workspaces(m)
    x = torch.randn(6, SHAPE["hidden_size"])
    out = m(x)
    assert len(pool) == 2  # forward and backward: the layers can train
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    pools = {id(layer._fused_options["workspace_pool"]) for layer in loaded}
    assert len(pools) == 1 and len(loaded[0]._fused_options["workspace_pool"]) == 0  # one pool, empty
    assert torch.equal(loaded(x), out)
    assert len(loaded[0]._fused_options["workspace_pool"]) == 2 and len(pool) == 2


def test_a_pickled_model_still_shares_one_pool():
    """torch.save of a whole model: the pool comes back empty and still shared by its layers."""
    run_world(1, check_pickled_model_keeps_sharing, env=INTERPRET)
