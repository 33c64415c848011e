"""Which host operations wait for the kernels already running on the device?

An emulated world (kosmos_moe.fabric.EmulatedWorld) drives every rank's launches from one
host thread while the earlier ranks' persistent kernels spin waiting for the later ranks: any
operation on that path that waits for the running kernels holds back the launch they wait
for, and the world stalls until a wait bound runs out. This instrument runs, per operation:
a one-program kernel on stream A that spins until a flag is set (or about ``--seconds``
pass); the operation; then the kernel that sets the flag, on stream B. The spinner reports
how long it polled: an operation that did not wait leaves it a few thousand polls, one that
waited for it keeps the host for the whole bound.

    python benchmarks/host_blocking.py [--seconds 3] [--out results.json]

Started with ``EmulatedWorld.ENVIRONMENT`` (eager module loading, 32 hardware queues), as an
emulated world must be.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

from common import log, require_cuda

import torch
import triton
import triton.language as tl

from kosmos_moe.fabric import EmulatedWorld


@triton.jit
def spin_kernel(flag_ptr, polls_ptr, bound):
    polls = 0
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while (seen == 0) & (polls < bound):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.store(polls_ptr, polls)


@triton.jit
def set_kernel(flag_ptr):
    tl.atomic_xchg(flag_ptr, 1, sem="release", scope="gpu")


class Operations:
    """The operations tried, each a method ``op_<name>`` run between the two launches."""

    def __init__(self, stream_b: torch.cuda.Stream) -> None:
        self.b = stream_b
        self.fresh = iter(range(1, 10_000))
        self.tmp = tempfile.mkdtemp(prefix="host_blocking_")
        self.pending = {}

    def prepare(self, name: str) -> None:
        """Inputs made before the spinner starts, so that only the operation itself is timed."""
        k = next(self.fresh)
        if name == "gemm_new_shape":  # far from the one small product run before: another kernel
            a = torch.randn(2048 + k, 1024, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            self.pending[name] = (a, w)
        if name == "addmm_new_variant":  # the plain product runs first, on the same stream: only addmm's kernel is new
            a, w = self._product_run_once(40 + k)
            c = torch.randn(40 + k, 72, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            self.pending[name] = (a, w, c)
        if name == "gemm_seen_shape":
            self.pending[name] = self._product_run_once(64)
        if name == "triton_new_kernel":
            path = os.path.join(self.tmp, f"fresh_{k}.py")
            with open(path, "w") as f:
                f.write("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef fresh(p):\n"
                        f"    tl.store(p, tl.load(p) + {k})\n")
            spec = importlib.util.spec_from_file_location(f"fresh_{k}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            target = torch.zeros(1, device="cuda")
            module.fresh.warmup(target, grid=(1,))  # compiled here; its module loads at the first launch
            torch.cuda.synchronize()
            self.pending[name] = (module.fresh, target)

    def _product_run_once(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Operands of a ``[rows, 96] @ [96, 72]`` bf16 product, run once on stream B."""
        a = torch.randn(rows, 96, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(96, 72, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.b):
            a @ w
        torch.cuda.synchronize()
        return a, w

    def op_nothing(self) -> None:
        pass

    def op_device_alloc(self) -> None:
        torch.empty((256 + next(self.fresh)) << 20, dtype=torch.uint8, device="cuda")  # a new segment: cudaMalloc

    def op_device_alloc_on_b(self) -> None:
        with torch.cuda.stream(self.b):
            torch.empty((256 + next(self.fresh)) << 20, dtype=torch.uint8, device="cuda")

    def op_pinned_host_alloc(self) -> None:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)

    def op_zero_fill_on_b(self) -> None:
        with torch.cuda.stream(self.b):
            torch.zeros(1 << 20, device="cuda")

    def op_elementwise_on_b(self) -> None:
        with torch.cuda.stream(self.b):
            torch.ones(1000, device="cuda", dtype=torch.bfloat16).mul_(3)

    def op_gemm_seen_shape(self) -> None:
        a, w = self.pending.pop("gemm_seen_shape")
        with torch.cuda.stream(self.b):
            a @ w

    def op_gemm_new_shape(self) -> None:
        a, w = self.pending.pop("gemm_new_shape")
        with torch.cuda.stream(self.b):
            a @ w

    def op_addmm_new_variant(self) -> None:
        # The same product as a GEMM already run at this shape just before, then as addmm
        # (cuBLAS' beta-add kernel).
        a, w, c = self.pending.pop("addmm_new_variant")
        with torch.cuda.stream(self.b):
            torch.addmm(c, a, w)

    def op_triton_new_kernel(self) -> None:
        fresh, target = self.pending.pop("triton_new_kernel")  # compiled already: this loads and launches it
        with torch.cuda.stream(self.b):
            fresh[(1,)](target)

    def op_stream_from_torch_pool(self) -> None:
        torch.cuda.Stream()  # torch made its pool's CUDA streams at the first Stream(): none is created here

    def op_empty_cache(self) -> None:
        torch.cuda.empty_cache()  # frees cached segments: cudaFree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="the spinner's bound, about")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    EmulatedWorld.set_environment()  # before CUDA starts: the device query in require_cuda reads them
    require_cuda("host_blocking.py")

    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    polls = torch.zeros(1, dtype=torch.int64, device="cuda")
    # Calibrate the bound with the flag never set (compiles both kernels first).
    set_kernel[(1,)](torch.zeros(1, dtype=torch.int32, device="cuda"))
    spin_kernel[(1,)](flag, polls, 1 << 22)
    torch.cuda.synchronize()
    start = time.perf_counter()
    spin_kernel[(1,)](flag, polls, 1 << 22)
    torch.cuda.synchronize()
    bound = int((1 << 22) * args.seconds / (time.perf_counter() - start)) // 16 * 16  # one specialisation
    spin_kernel[(1,)](flag, polls, bound)
    torch.cuda.synchronize()
    # cuBLAS' handle and stream B's workspace are made here, by one small product: the
    # operations below see only the kernels they choose.
    with torch.cuda.stream(b):
        torch.ones(16, 16, device="cuda", dtype=torch.bfloat16) @ torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ops = Operations(b)
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"spinner bound {bound} polls (about {args.seconds} s)")
    names = ["nothing", "gemm_new_shape", "gemm_seen_shape", "addmm_new_variant", "triton_new_kernel",
             "device_alloc", "device_alloc_on_b", "pinned_host_alloc", "zero_fill_on_b", "elementwise_on_b",
             "stream_from_torch_pool", "empty_cache", "nothing"]
    assert set(names) == {n[3:] for n in dir(Operations) if n.startswith("op_")}
    results = []
    for name in names:
        ops.prepare(name)
        flag.zero_()
        polls.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            spin_kernel[(1,)](flag, polls, bound)
        t0 = time.perf_counter()
        getattr(ops, f"op_{name}")()
        t1 = time.perf_counter()
        with torch.cuda.stream(b):
            set_kernel[(1,)](flag)
        torch.cuda.synchronize()
        seen = int(polls.item())
        # The spinner ran out and the host was held about as long: it waited (no operation
        # here takes a second of its own; compiles are done in prepare).
        waited = seen >= bound and t1 - t0 >= 0.5 * args.seconds
        results.append({"operation": name, "host_seconds": t1 - t0, "spinner_polls": seen, "bound": bound,
                        "waited_for_running_kernels": waited})
        log(f"{name:22s} host {1e3 * (t1 - t0):9.2f} ms, spinner polled {seen:>10d}: "
            + ("WAITED for the running kernel" if waited else "did not wait"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
