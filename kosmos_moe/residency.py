"""How many programs of a compiled kernel a GPU keeps resident at once.

A persistent kernel's workers spin on each other's signals, so every worker of every rank
sharing a device must be resident together: a worker left waiting for a free SM would never
get one (DESIGN.md: size the grid from the kernel's measured occupancy). The tiles ask for
``workers_per_sm`` workers per SM; whether the compiled kernel (its registers, shared memory
and warps) allows that is only known after the compile, so :func:`require_resident` checks it
before a kernel's first launch and refuses a grid that would strand workers.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
        ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def blocks_per_sm(compiled) -> int:
    """Programs of ``compiled`` (a loaded Triton ``CompiledKernel``) resident per SM at once.

    The driver's own occupancy calculator, with the kernel's block size and the dynamic shared
    memory Triton launches it with, so every hardware rule (register allocation granularity,
    shared memory reserved per block, block and warp limits) is the driver's.
    """
    blocks = ctypes.c_int(0)
    threads = compiled.metadata.num_warps * 32
    status = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), threads, compiled.metadata.shared)
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {status}")
    return blocks.value


def require_resident(compiled, programs: int, what: str) -> None:
    """Raise unless ``programs`` programs of ``compiled`` fit on the current device at once.

    ``programs`` counts every rank's grid on the device (an emulated world's ranks share it).
    """
    per_sm = blocks_per_sm(compiled)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if programs > per_sm * sms:
        raise RuntimeError(
            f"{what}: {programs} workers on this device cannot all be resident: the compiled kernel "
            f"({compiled.n_regs} registers per thread, {compiled.metadata.shared} B of shared memory, "
            f"{compiled.metadata.num_warps} warps) fits {per_sm} per SM on {sms} SMs, and a worker left "
            "waiting for an SM would strand the workers waiting on it; lower the tiles' workers_per_sm "
            "or workers_per_rank"
        )
