"""The fabric: where each rank's workspace lives and how peers address it.

The fused kernels take one thing from the fabric: an int64 table of every rank's workspace
base address, plus the local rank. Three fabrics fill that table:

* :class:`SymmetricMemoryFabric`: one process per GPU (``torchrun``), workspaces from
  ``torch.distributed._symmetric_memory``; peers are reached over NVLink by plain loads and
  stores, signals use system-scope atomics.
* :class:`EmulatedWorld`: R virtual ranks in one process on one device. On a GPU each rank
  launches on its own stream with at most ``SMs / R`` workers, so all ranks are resident at
  once. On the CPU it is limited to one rank (Triton's interpreter runs programs one after
  another, so two ranks in one process would wait on each other forever).
* :class:`SharedFileFabric`: R CPU processes (a gloo group) running the kernels under Triton's
  interpreter, with workspaces in ``/dev/shm`` files that every rank maps.

A workspace request is collective: every rank of a fabric makes the same requests in the
same order, and the n-th request of each rank is paired with the n-th of its peers.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist


# The kernels tell the compiler that every workspace base is a multiple of this (so that rows
# move in 16-byte vectors); kernels.signals.WORKSPACE_ALIGN is the same number.
WORKSPACE_ALIGN = 256


def _aligned(addresses: list[int], device: torch.device) -> list[int]:
    if device.type != "cuda":
        return addresses  # the interpreter does not vectorise; CPU allocations are 64-byte aligned
    bad = [a for a in addresses if a % WORKSPACE_ALIGN]
    if bad:
        raise RuntimeError(f"workspace addresses {bad} are not {WORKSPACE_ALIGN}-byte aligned; the fused kernels need them so")
    return addresses


@dataclass(eq=False)
class Workspace:
    """One rank's workspace (``local``, uint8) and every rank's base address (``peers``).

    ``failed`` holds the error of a call that left it inconsistent (a timeout, a call refused
    on one rank of several): every launcher using it refuses later calls.
    """

    local: torch.Tensor
    peers: torch.Tensor
    keepalive: tuple = ()
    failed: Exception | None = None
    #: (stream, event) of the latest call that used it, on a GPU: a call from another stream
    #: waits for that event before its launch (the fused launchers' ``_after_other_streams``).
    last_use: tuple | None = None


class Fabric:
    """A rank's view of an expert-parallel world: its rank, the world size, peer memory."""

    rank: int
    world_size: int
    device: torch.device
    #: Scope of the signal atomics: "sys" when peers are other devices, else "gpu".
    signal_scope: str = "gpu"
    #: How many ranks share this device; each gets at most SMs x workers_per_sm / ranks_per_device workers.
    ranks_per_device: int = 1

    def workspace(self, nbytes: int) -> Workspace:
        raise NotImplementedError

    def domain(self) -> Hashable:
        """What identifies this rank's peers: fabrics of equal domains may share workspaces
        (:class:`kosmos_moe.WorkspacePool`). By default none shares."""
        return self

    def barrier(self) -> None:
        """Wait for every rank of the world to get here; only ranks in separate processes wait."""

    def max_workers(self, per_sm: int = 1) -> int:
        """Workers per rank that can be resident together with every co-located rank, for a
        kernel that fits ``per_sm`` programs per SM (checked against the compiled kernel by
        ``kosmos_moe.residency.require_resident`` before its first launch)."""
        if self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(1, sms * per_sm // self.ranks_per_device)


class EmulatedWorld:
    """R virtual ranks on one device, driven from one thread.

    ``world.rank(r)`` is the fabric of rank r. Launches never wait on the host, so calling each
    rank's layer in turn, each under :meth:`run`'s per-rank stream, keeps all R kernels in
    flight together.

    Two settings, both read by CUDA once when it starts (:meth:`set_environment` sets them;
    the world warns without them):

    * ``CUDA_MODULE_LOADING=EAGER``. CUDA otherwise loads a module (a torch kernel, a cuBLAS
      GEMM) at its first launch, and a load may wait for the kernels running on the device:
      here the earlier ranks' persistent kernels, which wait for this rank. On an H200, world
      of 4 (benchmarks/world_liveness.py): one GEMM or one elementwise kernel added to each
      rank's step between its forward and backward launches stalled the world in every run,
      even with the GEMM's shapes run once beforehand (the autograd thread picked another
      kernel); with eager loading the same run finished. The same stall, with the shared
      experts' GEMMs in that place, stopped worlds of 4 with a shared expert, and earlier the
      host 1.6-6 s between two ranks' first launches.
    * ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (the default is 8): a hardware queue per rank stream.
      Streams that share a queue are launched in queue order, so rank r's backward, which
      waits in the queue for rank r's forward to finish, holds back the forward of a rank
      queued behind it, which rank r's forward waits for. On an H200 a world of 8 whose ranks
      each ran forward then backward hung with 8 connections and finished with 32.

    Anything else a rank's step does the first time on the host (a cuBLAS handle, a first
    allocation) is done before the first fused call by running each rank's batch once through
    the same model without the fused backend, under its rank's stream (:meth:`rehearse`).
    That matters because loading GPU code waits for the running kernels, eager loading
    included: on an H100 (torch 2.11, Triton 3.6, ``benchmarks/host_blocking.py`` under this
    class's ENVIRONMENT, stop 30) each of these held the host until a spinning kernel gave up,
    3 s later: a bf16 GEMM at a shape the process had not run, ``addmm`` just after the plain
    product of its shapes had run (another cuBLAS kernel, the beta-add one), the first launch
    of a Triton kernel compiled beforehand (its module load) and ``torch.cuda.empty_cache``
    (cudaFree). A GEMM at shapes run before, device and pinned allocations, zero fills, an
    elementwise torch kernel (loaded eagerly when CUDA started) and a stream from torch's pool
    returned in under 2 ms. So while any rank's kernel waits for a launch still to come
    (from the first rank's forward launch to the last rank's last launch), the host may run
    only kernels the rehearsal ran, GEMMs at the same shapes: the shared experts' backward runs
    the module's own products (kosmos_moe.experts.shared_experts_backward). Its ``addmm``
    stalled worlds of 2 to 8 with a shared expert at stop 28: the autograd thread sat in it for
    the whole wait bound while rank 0's forward waited for rank 1's launch. With the products,
    the three tests that stalled and the whole backward GPU suite (22 tests, worlds of 1-8)
    passed on an H100 at stop 30.

    With both settings and a rehearsal, a world of 4 with a shared expert whose ranks each ran
    forward then backward stalled on the H200 in its second call (counts 0, 300, 1, 517) while
    the shared experts' GEMMs ran between each rank's two launches: the last rank's backward
    started after its peers' wait bound, at 33 and 30 workers per rank (it finished at 24 and
    16). With those GEMMs inside the forward launch and after the backward launch
    (FusedExpertsFunction), the same world finished at 33 workers per rank, a world of 8 at 16
    (world_liveness ``recommended``), and the backward and training GPU suites passed (H200,
    stop 23; the H100 timeouts of stop 28 were the ``addmm`` above). The default stays all SMs
    shared by the ranks.
    """

    #: What CUDA must be started with for an emulated world (see the class docs).
    ENVIRONMENT = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}

    def __init__(self, world_size: int, device: torch.device | str = "cuda") -> None:
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda" and world_size > 1:
            raise ValueError(
                "an emulated world of several ranks needs a GPU; on the CPU use one process per rank "
                "(SharedFileFabric), since Triton's interpreter runs programs one after another"
            )
        if self.device.type == "cuda" and world_size > 1:
            wrong = {k: os.environ.get(k) for k, v in self.ENVIRONMENT.items() if os.environ.get(k) != v}
            if wrong:
                warnings.warn(
                    f"an emulated world of {world_size} ranks with {wrong}: its ranks' persistent kernels can wait "
                    f"forever for a peer held back by a lazy module load or a shared hardware queue; start CUDA with "
                    f"{self.ENVIRONMENT} (EmulatedWorld.set_environment() before CUDA starts)",
                    stacklevel=2,
                )
        self._allocations: list[tuple] = []
        self._requests = [0] * world_size
        self.streams = (
            [torch.cuda.Stream(self.device) for _ in range(world_size)] if self.device.type == "cuda" else None
        )

    @classmethod
    def set_environment(cls) -> None:
        """Set :attr:`ENVIRONMENT` where the caller has not set those variables; CUDA reads them
        when it starts, so call this before the first CUDA call of the process."""
        if torch.cuda.is_initialized():
            raise RuntimeError("EmulatedWorld.set_environment() must run before CUDA starts")
        for key, value in cls.ENVIRONMENT.items():
            os.environ.setdefault(key, value)

    def rank(self, r: int) -> "EmulatedFabric":
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} outside an emulated world of {self.world_size}")
        return EmulatedFabric(self, r)

    def _workspace(self, r: int, nbytes: int) -> Workspace:
        n = self._requests[r]
        self._requests[r] += 1
        if n == len(self._allocations):
            # Every rank's buffer and the address table are made at the first rank's request,
            # before any kernel of this world runs: later ranks ask while their peers' kernels
            # are already waiting for them, and must not synchronise the device then.
            buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
            peers = torch.tensor(_aligned([b.data_ptr() for b in buffers], self.device), dtype=torch.int64, device=self.device)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self._allocations.append((buffers, peers, ready))
        buffers, peers, ready = self._allocations[n]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)  # zeroed before this rank's first use
        if buffers[r].numel() != nbytes:
            raise ValueError(
                f"rank {r} asked for a workspace of {nbytes} bytes, its peers for {buffers[r].numel()}: "
                "every rank must build the same layer with the same max_tokens_per_rank"
            )
        return Workspace(buffers[r], peers)

    def run(self, fn, *per_rank_args):
        """Call ``fn(r, *args_r)`` for every rank, each on its own stream; return the results.

        The caller's stream waits for every rank before the results are used.
        """
        results = []
        if self.streams is None:
            return [fn(r, *(a[r] for a in per_rank_args)) for r in range(self.world_size)]
        current = torch.cuda.current_stream(self.device)
        # Every rank starts after what the caller queued before this call, and after nothing
        # else: any work rank r's fn leaves on the caller's stream waits for rank r's kernels,
        # which wait for rank r + 1's; had rank r + 1's stream waited for the caller's stream
        # as it stands at its turn, its kernels would never start.
        start = torch.cuda.Event()
        start.record(current)
        for r, stream in enumerate(self.streams):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                results.append(fn(r, *(a[r] for a in per_rank_args)))
        for stream in self.streams:
            current.wait_stream(stream)
        return results

    def rehearse(self, module, inputs, grads) -> None:
        """Run ``module`` forward and backward on every rank's input, each under its rank's
        stream, with no persistent kernel in flight; then wait for the device.

        Every CUDA kernel (and library handle) a rank's step needs around its fused launches
        is then loaded, so none is loaded lazily while the peers' kernels spin (see the class
        docs). Gradients are taken with ``autograd.grad``: no ``.grad`` is touched. ``module``
        must not use the fused backend (its kernels would wait for peers).
        """
        params = [p for p in module.parameters() if p.requires_grad]

        def step(r, x, g):
            x = x.detach().requires_grad_(True)
            torch.autograd.grad(module(x), [x, *params], g, allow_unused=True)

        self.run(step, inputs, grads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class EmulatedFabric(Fabric):
    """Rank ``rank`` of an :class:`EmulatedWorld`."""

    def __init__(self, world: EmulatedWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.device = world.device
        self.ranks_per_device = world.world_size

    def workspace(self, nbytes: int) -> Workspace:
        return self.world._workspace(self.rank, nbytes)

    def domain(self) -> Hashable:
        # One rank alone has no peers: every world of one on a device is the same domain.
        return ("emulated", self.device, self.world if self.world_size > 1 else None, self.rank)


def _check_same_size(nbytes: int, group: dist.ProcessGroup) -> None:
    """Raise on every rank if the ranks ask for workspaces of different sizes (a collective)."""
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, nbytes, group=group)
    if len(set(sizes)) != 1:
        raise ValueError(f"ranks asked for workspaces of different sizes {sizes}: every rank must build the same "
                         "layer with the same max_tokens_per_rank")


class SharedFileFabric(Fabric):
    """CPU ranks in separate processes; workspaces are ``/dev/shm`` files every rank maps."""

    def __init__(self, group: dist.ProcessGroup | None = None, directory: str = "/dev/shm") -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device("cpu")
        self.directory = directory
        name = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.prefix = os.path.join(directory, f"kosmos-moe-{name[0]}")
        self._requests = 0

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def domain(self) -> Hashable:
        return ("shared_file", self.group, self.directory)

    def workspace(self, nbytes: int) -> Workspace:
        n = self._requests
        self._requests += 1
        _check_same_size(nbytes, self.group)  # before any file exists: a refusal leaves none behind
        path = lambda r: f"{self.prefix}-{n}-{r}"  # noqa: E731
        made = False
        try:
            try:
                with open(path(self.rank), "wb") as f:
                    f.truncate(nbytes)
                made = True
            finally:
                self._all_ok("making its workspace file", made)  # every rank's file exists
            maps = []
            try:
                maps = [torch.from_file(path(r), shared=True, size=nbytes, dtype=torch.uint8)
                        for r in range(self.world_size)]
            finally:
                self._all_ok("mapping its peers' workspace files", len(maps) == self.world_size)
        finally:
            if made:
                os.unlink(path(self.rank))  # the mappings stay valid; nothing is left behind in /dev/shm
        peers = torch.tensor(_aligned([m.data_ptr() for m in maps], self.device), dtype=torch.int64)
        return Workspace(maps[self.rank], peers, keepalive=tuple(maps))

    def _all_ok(self, step: str, ok: bool) -> None:
        """Every rank says whether ``step`` worked (a collective, in place of a barrier); if one
        did not, every rank raises, so that none is left waiting for it in the next collective."""
        oks = [None] * self.world_size
        dist.all_gather_object(oks, ok, group=self.group)
        failed = [r for r, good in enumerate(oks) if not good]
        if failed and ok:  # the failing rank raises its own error
            raise RuntimeError(f"rank {self.rank}: a shared-file workspace failed at {step} on rank(s) {failed}")


class SymmetricMemoryFabric(Fabric):
    """One GPU per process; workspaces from torch symmetric memory over the EP group."""

    signal_scope = "sys"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def domain(self) -> Hashable:
        return ("symmetric_memory", self.group, self.device)

    def workspace(self, nbytes: int) -> Workspace:
        import torch.distributed._symmetric_memory as symm_mem

        _check_same_size(nbytes, self.group)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.zero_()
        handle = symm_mem.rendezvous(buffer, self.group.group_name)
        peers = torch.tensor(_aligned(list(handle.buffer_ptrs), self.device), dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every peer's zeroed workspace exists before any kernel runs
        return Workspace(buffer, peers, keepalive=(handle,))


def default_fabric(group: dist.ProcessGroup | None, device: torch.device) -> Fabric:
    """The fabric an ExpertLayer uses when none is given."""
    if group is None or dist.get_world_size(group) == 1:
        return EmulatedWorld(1, device).rank(0)
    if device.type == "cuda":
        return SymmetricMemoryFabric(group)
    return SharedFileFabric(group)
