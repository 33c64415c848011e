"""DirectLauncher: when it goes through Triton, and what it hands the compiled kernel's launcher.

The launcher itself needs a GPU (tests/test_fused_gpu.py runs every fused call through it);
here a stand-in kernel records what it is given.
"""

import dataclasses
import inspect

import pytest
import torch

from kosmos_moe.direct_launch import DirectLauncher


class FakeCompiled:
    function = "function-handle"
    packed_metadata = "packed"

    def __init__(self, fail: bool = False) -> None:
        self.runs = []
        self.fail = fail
        self.loaded = False

    def _init_handles(self):
        self.loaded = True

    def launch_metadata(self, grid, stream, *values):
        return ("meta", grid, stream)

    def run(self, *launch):
        if self.fail:
            raise TypeError("launcher signature changed")
        self.runs.append(launch)


class FakeKernel:
    """A ``@triton.jit`` stand-in: ``kernel[grid](*args, **constants)`` 'compiles' and launches."""

    arg_names = ["x", "n", "desc", "BLOCK", "FLAG"]

    def __init__(self, fail: bool = False) -> None:
        self.triton_calls = []
        self.warmups = []
        self.compiled = FakeCompiled(fail)

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.triton_calls.append((grid, args, constants))
            return self.compiled
        return launch

    def run(self, *args, grid, warmup, **constants):
        assert warmup, "the direct path compiles through run() only to look before launching"
        self.warmups.append((grid, args, constants))
        return self.compiled


@dataclasses.dataclass
class FakeDescriptor:
    """Fields as Triton's host ``TensorDescriptor`` has them."""

    base: torch.Tensor
    block_shape: list
    shape: list = dataclasses.field(init=False)
    strides: list = dataclasses.field(init=False)

    def __post_init__(self):
        self.shape, self.strides = list(self.base.shape), list(self.base.stride())


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(DirectLauncher, "current_device", staticmethod(lambda: 0))
    monkeypatch.setattr(DirectLauncher, "current_stream", staticmethod(lambda: 1234))
    return DirectLauncher(FakeKernel())


def test_second_call_goes_straight_to_the_launcher_with_every_parameter_in_order(launcher):
    x = torch.zeros(64, dtype=torch.bfloat16)
    desc = FakeDescriptor(torch.zeros(32, 16), [16, 16])
    constants = {"BLOCK": 64, "FLAG": True, "num_warps": 8}
    launcher((132,), (x, 37, desc), constants)
    assert len(launcher.kernel.triton_calls) == 1 and launcher.kernel.compiled.runs == []
    launcher((132,), (x, 53, desc), dict(constants))  # 37 -> 53: neither is 1 nor a multiple of 16
    assert len(launcher.kernel.triton_calls) == 1
    (run,) = launcher.kernel.compiled.runs
    grid, stream, function, packed, meta = run[:3], run[3], run[4], run[5], run[6]
    assert grid == (132, 1, 1) and stream == 1234 and function == "function-handle" and packed == "packed"
    assert meta == ("meta", (132, 1, 1), 1234)
    hooks, values = run[7:9], run[9:]
    assert len(hooks) == 2
    assert values[0] is x and values[1] == 53 and values[2] is desc and values[3:] == (64, True)


@pytest.mark.parametrize("change", ["misaligned_tensor", "int_one", "int_multiple_of_16", "large_int", "dtype",
                                    "constant", "descriptor_block", "grid"])
def test_a_change_triton_would_specialise_on_goes_through_triton(launcher, change):
    x = torch.zeros(64, dtype=torch.bfloat16)
    desc = FakeDescriptor(torch.zeros(32, 16), [16, 16])
    args, constants, grid = [x, 37, desc], {"BLOCK": 64, "FLAG": True}, (132,)
    launcher(grid, tuple(args), constants)
    if change == "misaligned_tensor":
        args[0] = x[1:]  # 2 bytes past a 16-byte boundary
    elif change == "int_one":
        args[1] = 1
    elif change == "int_multiple_of_16":
        args[1] = 48
    elif change == "large_int":
        args[1] = 2**31 + 1
    elif change == "dtype":
        args[0] = x.float()
    elif change == "constant":
        constants = {"BLOCK": 128, "FLAG": True}
    elif change == "descriptor_block":
        args[2] = FakeDescriptor(desc.base, [8, 16])
    elif change == "grid":
        grid = (66,)
    launcher(grid, tuple(args), constants)
    assert len(launcher.kernel.triton_calls) == 2 and launcher.kernel.compiled.runs == []
    launcher(grid, tuple(args), constants)  # and is then cached under its own key
    assert len(launcher.kernel.triton_calls) == 2 and len(launcher.kernel.compiled.runs) == 1


def _kernel_with_defaults(x, n, desc, BLOCK, FLAG, MODE=0):  # the signature FakeKernel stands in for
    pass


def test_a_constant_left_to_its_default_is_passed_at_its_default(monkeypatch):
    # The backward kernel's MODE: its launcher leaves it out, Triton fills in 0. The direct path
    # once raised KeyError('MODE') there and fell back to Triton for good (H200, every backward).
    monkeypatch.setattr(DirectLauncher, "current_device", staticmethod(lambda: 0))
    monkeypatch.setattr(DirectLauncher, "current_stream", staticmethod(lambda: 1234))
    kernel = FakeKernel()
    kernel.arg_names = FakeKernel.arg_names + ["MODE"]
    kernel.signature = inspect.signature(_kernel_with_defaults)
    launcher = DirectLauncher(kernel)
    args, constants = (torch.zeros(4), 3, FakeDescriptor(torch.zeros(4, 4), [4, 4])), {"BLOCK": 1, "FLAG": False}
    launcher((1,), args, constants)
    launcher((1,), args, constants)
    assert launcher.enabled and len(kernel.triton_calls) == 1
    (run,) = kernel.compiled.runs
    assert run[9 + 3:] == (1, False, 0)


def test_an_argument_of_unknown_type_always_goes_through_triton(launcher):
    args = (torch.zeros(4), object(), None)
    for _ in range(3):
        launcher((1,), args, {"BLOCK": 1, "FLAG": False})
    assert len(launcher.kernel.triton_calls) == 3 and launcher.kernel.compiled.runs == []


def test_a_launcher_that_rejects_the_call_turns_the_direct_path_off(monkeypatch):
    monkeypatch.setattr(DirectLauncher, "current_device", staticmethod(lambda: 0))
    monkeypatch.setattr(DirectLauncher, "current_stream", staticmethod(lambda: 1234))
    launcher = DirectLauncher(FakeKernel(fail=True))
    args, constants = (torch.zeros(4), 3, FakeDescriptor(torch.zeros(4, 4), [4, 4])), {"BLOCK": 1, "FLAG": False}
    launcher((1,), args, constants)
    launcher((1,), args, constants)  # direct launch raises: this call is relaunched through Triton
    assert not launcher.enabled and len(launcher.kernel.triton_calls) == 2
    launcher((1,), args, constants)
    assert len(launcher.kernel.triton_calls) == 3


def test_a_check_sees_each_compiled_kernel_before_its_first_launch(launcher):
    # kosmos_moe.residency.require_resident refuses a grid that cannot all be resident: it must
    # run before anything is launched, and again for a kernel compiled for new traits.
    seen = []

    def check(compiled):
        assert compiled.loaded and launcher.kernel.triton_calls == [], "checked after a launch"
        seen.append(compiled)

    x = torch.zeros(64, dtype=torch.bfloat16)
    constants = {"BLOCK": 64, "FLAG": True}
    launcher((132,), (x, 37, None), constants, check)  # None: an argument the launcher cannot key on
    assert seen == [launcher.kernel.compiled] and len(launcher.kernel.triton_calls) == 1
    seen.clear()
    launcher.kernel.triton_calls.clear()
    desc = FakeDescriptor(torch.zeros(32, 16), [16, 16])
    launcher((132,), (x, 37, desc), constants, check)
    launcher((132,), (x, 53, desc), constants, check)  # same traits: cached, not checked again
    assert len(seen) == 1 and len(launcher.kernel.triton_calls) == 1 and len(launcher.kernel.compiled.runs) == 1


def test_a_refusing_check_launches_nothing(launcher):
    def refuse(compiled):
        raise RuntimeError("264 workers on this device cannot all be resident")

    args = (torch.zeros(4), 3, FakeDescriptor(torch.zeros(4, 4), [4, 4]))
    for _ in range(2):  # nothing is cached for a refused kernel: the next call is refused too
        with pytest.raises(RuntimeError, match="cannot all be resident"):
            launcher((264,), args, {"BLOCK": 1, "FLAG": False}, refuse)
    assert launcher.kernel.triton_calls == [] and launcher.kernel.compiled.runs == []
