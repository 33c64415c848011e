"""Run a test body in W separate processes joined by a gloo process group."""

from __future__ import annotations

import gc
import os
import tempfile
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

import interpreter_patching

#: The children's environment of a world that runs the kernels under Triton's interpreter.
INTERPRET = {"TRITON_INTERPRET": "1"}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _entry(rank: int, world: int, init_file: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    interpreter_patching.install()
    # A collective that one rank never joins fails the test after this long, instead of holding
    # CI for gloo's default 30 minutes per collective.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        fn(rank, world, *args)
    finally:
        # What the body left in reference cycles (a caught exception's frames, FSDP2 states)
        # may hold process groups or device meshes: free it while the default group is up.
        # Left to the interpreter's exit, their destructors aborted the process now and then
        # ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def run_world(world: int, fn, *args, env: dict[str, str] | None = None) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` processes; any rank's exception fails the test.

    ``env`` is set in the children's environment only (e.g. ``TRITON_INTERPRET=1``, which must
    be set before Triton decorates the kernels).
    """
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_entry, args=(world, os.path.join(tmp, "rendezvous"), fn, args), nprocs=world, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
