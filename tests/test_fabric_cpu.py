"""EmulatedWorld on the CPU: rehearse runs the step and touches no gradient or weight; set_environment."""

import os

import pytest
import torch

from kosmos_moe import ExpertLayer
from kosmos_moe.fabric import EmulatedWorld


def test_rehearse_runs_the_step_and_leaves_grads_alone():
    torch.manual_seed(0)
    layer = ExpertLayer(16, 8, 4, 2, num_shared_experts=1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    calls = []
    forward = layer.forward
    layer.forward = lambda x: calls.append(x.shape) or forward(x)
    x, g = torch.randn(5, 16), torch.randn(5, 16)
    EmulatedWorld(1, "cpu").rehearse(layer, [x], [g])
    assert calls == [torch.Size([5, 16])]
    assert all(p.grad is None for p in layer.parameters())
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_set_environment_fills_in_what_the_caller_left_unset(monkeypatch):
    for key in EmulatedWorld.ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")  # the caller's choice stands
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    EmulatedWorld.set_environment()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "16"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA starts"):
        EmulatedWorld.set_environment()


def check_shared_files(rank, world, directory):
    import torch.distributed as dist

    from kosmos_moe.fabric import SharedFileFabric

    fabric = SharedFileFabric(dist.group.WORLD, directory=directory)
    workspace = fabric.workspace(64)
    workspace.local[0] = rank + 1
    fabric.barrier()
    # Every rank's buffer, as this rank maps it, holds what its owner wrote.
    assert [int(m[0]) for m in workspace.keepalive] == [r + 1 for r in range(world)]
    with pytest.raises(ValueError, match="workspaces of different sizes \\[64, 128\\]"):
        fabric.workspace(64 * (rank + 1))
    fabric.barrier()
    assert os.listdir(directory) == [], "a workspace left files behind"


def test_shared_file_workspaces_leave_nothing_behind(tmp_path):
    """Files are unlinked once every rank mapped them, and ranks asking for different sizes
    are refused on every rank before any file is made."""
    from multiprocess import run_world

    run_world(2, check_shared_files, str(tmp_path))


def check_one_rank_cannot_make_its_file(rank, world, directory):
    import torch.distributed as dist

    from kosmos_moe.fabric import SharedFileFabric

    fabric = SharedFileFabric(dist.group.WORLD, directory=directory if rank == 0 else os.path.join(directory, "absent"))
    if rank == 1:
        with pytest.raises(FileNotFoundError):
            fabric.workspace(64)
    else:
        with pytest.raises(RuntimeError, match=r"failed at making its workspace file on rank\(s\) \[1\]"):
            fabric.workspace(64)
    fabric.barrier()  # neither rank is left in a collective
    assert not os.path.exists(directory) or os.listdir(directory) == [], "a refused workspace left files behind"


def test_a_rank_that_cannot_make_its_file_fails_every_rank(tmp_path):
    from multiprocess import run_world

    run_world(2, check_one_rank_cannot_make_its_file, str(tmp_path))
