import logging
import os
import sys
from pathlib import Path

import pytest
import torch

# The oracle and the multi-process helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

import interpreter_patching  # noqa: E402
from kosmos_moe.fabric import EmulatedWorld  # noqa: E402  (importing torch does not start CUDA)

# The interpreter without its redundant per-call re-patching (about 40% of a fused forward and
# backward's interpreter time; tests/interpreter_patching.py). Spawned ranks install it too.
interpreter_patching.install()

# Emulated worlds need eager module loading and a hardware queue per rank stream (see
# EmulatedWorld); CUDA reads both once, when it starts, which is after this file is imported.
EmulatedWorld.set_environment()


def pytest_runtest_logreport(report):
    """Print a failure's report as soon as the test fails, not in the summary at the end.

    GPU runs have a hard time limit: a run cut short by it would otherwise lose every failure
    message, since pytest writes them only once the whole session ends.
    """
    if report.failed:
        print(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n", file=sys.stderr, flush=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto`` (the README's test command): without a GPU the usable CPUs, at
    most 8; with one, none (a single process).

    Without a GPU nearly every test runs the kernels under Triton's interpreter, single-threaded
    Python, so two workers on a two-core machine like CI's took the suite from 1,313 to 923 s at
    the same commit (stop 61). Past about 8 workers the slowest tests (30-55 s) bound the run while
    every worker still imports torch and Triton. GPU tests share one device and time their bounded
    waits, so they keep to one process.
    """
    if torch.cuda.is_available():
        return 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, usable)


def pytest_configure(config):
    """``KOSMOS_TRACE_LAUNCHES=1``: log every fused launch with its host time, rank and stream.

    In an emulated world a rank whose launch comes long after its peers' shows where the host
    stalled while their kernels waited for it (see benchmarks/world_liveness.py).
    """
    if os.environ.get("KOSMOS_TRACE_LAUNCHES", "0") not in ("", "0"):
        logging.basicConfig(stream=sys.stderr, format="%(name)s %(message)s")
        logging.getLogger("kosmos_moe.fused").setLevel(logging.DEBUG)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """``KOSMOS_SAMPLE_STACKS=DIR``: every thread's stack during each test, sampled, with the
    fused launches, one file per test in DIR (tests/stack_sampler.py): where the host was held
    while a stalled world's kernels waited."""
    directory = os.environ.get("KOSMOS_SAMPLE_STACKS")
    if not directory:
        yield
        return
    from stack_sampler import StackSampler, sample_file

    with StackSampler(sample_file(directory, item.nodeid)):
        yield
