"""Host side of the fused forward and backward: workspaces, launches, and turning kernel timeouts into errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NoReturn

import torch
from torch import nn

from .config import MoEConfig
from .direct_launch import DirectLauncher
from .experts import shared_experts_backward
from .fabric import EmulatedFabric, EmulatedWorld, Fabric
from .residency import require_resident
from .sharing import WorkspacePool
from .workspace import (
    GPU_BACKWARD_TILES, GPU_TILES, INTERPRETER_BACKWARD_TILES, INTERPRETER_TILES, BackwardTiles, Tiles,
    WorkspaceLayout, backward_layout, forward_layout, gpu_backward_tiles,
)

# Polls before a wait gives up. On the H200 1 << 22 polls of the count exchange took under
# 1.6 s (a rank timed out while its peer launched 1.57 s after it), so 1 << 27 is under a
# minute: long enough for ranks whose first calls compile at different speeds (16-27 s per
# shape), short enough that a peer that never comes is reported, not waited for. An
# interpreter poll (one idle pass of the worker loop in numpy) took 4.0 ms on a two-core CPU
# host (a world of 2, 4 experts, nothing else running; about twice that beside other work),
# so 15,000 polls is about a minute there. ``fused_options={"wait_bound": n}`` sets another.
GPU_WAIT_BOUND = 1 << 27
INTERPRETER_WAIT_BOUND = 15_000

# ``logging.getLogger("kosmos_moe.fused").setLevel(logging.DEBUG)`` logs every launch with its
# host time, rank and stream: in an emulated world, a rank whose launch comes seconds after
# its peers' shows where the host stalled while their kernels waited for it.
log = logging.getLogger(__name__)

_ERROR_WORDS = 8
_WHAT = {
    1: "the count-exchange signal of rank {peer} (expected epoch {expected}, saw {observed})",
    2: "its own route tiles ({observed} of {expected} done)",
    3: "the dispatched rows of local expert {index} ({observed} of {expected} arrived)",
    4: "the gate/up tiles of a row tile (down task {task})",
    5: "the combined results of local token {index} ({observed} of {expected} result blocks arrived)",
    6: "the shared expert's gate/up tiles (shared down task {task})",
    7: "its own layout tiles (step {index}: {observed} of {expected} done)",
    8: "the SwiGLU-backward tiles of a row tile (dx task {task})",
    9: "the routing-weight gradients of local token {index} ({observed} of {expected} arrived)",
    10: "the SwiGLU-backward tiles of a local expert (weight-gradient tasks)",
}
_ERR_SHORT = 11
# The ways an emulated world was measured to stall with every rank launched (EmulatedWorld).
_EMULATED_HINT = (
    f" In an emulated world, check that CUDA was started with {EmulatedWorld.ENVIRONMENT} and that each rank's "
    "batch was rehearsed once (EmulatedWorld.rehearse) before its first fused call."
)


def _tma_ok(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...]) -> bool:
    # The copy engine needs Hopper or later (the interpreter emulates it) and 16-byte aligned
    # row strides, i.e. widths that are multiples of 16 bytes.
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return all(w * dtype.itemsize % 16 == 0 for w in widths)


def tma_usable(tiles: Tiles, config: MoEConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the forward reads its weight blocks by TMA (``tiles.tma`` asks for it): Hopper or
    later and hidden, intermediate and shared widths that are multiples of 16 bytes."""
    widths = (config.hidden_size, config.moe_intermediate_size, config.shared_intermediate_size or 8)
    return tiles.tma and _tma_ok(device, dtype, widths)


def backward_tma_usable(config: MoEConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the backward kernel may read GEMM operands by TMA (``BackwardTiles.wgrad_tma``,
    ``tile_tma``).

    The kernel makes the descriptors itself, over an expert's rows of ``[R, 2I]``, ``[R, H]``
    and ``[R, I]`` buffers and over its weights: Hopper or later and hidden and intermediate
    widths that are multiples of 16 bytes.
    """
    return _tma_ok(device, dtype, (config.hidden_size, config.moe_intermediate_size))


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Triton asks for global scratch at each launch of a kernel that makes tensor descriptors
    # on the device (128 bytes per descriptor and program); the caching allocator serves it.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Give Triton an allocator for kernel scratch memory unless the caller already set one.

    Triton keeps it in a context variable: autograd runs the backward on its own device
    thread, where the caller's setting (if any) is not seen, so this runs before each launch.
    """
    import triton

    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # a Triton without the context variable: set ours
        triton.set_allocator(_torch_scratch)
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_torch_scratch)


def weight_descriptors(experts: nn.Module, shared_mlp: nn.Module | None, tiles: Tiles) -> tuple:
    """TMA descriptors of the routed and shared expert weights, in the forward kernel's order.

    Each covers all of a weight's rows (``[experts * rows, K]``), with the block the tiles read:
    ``[gate_up_cols, depth]`` for gate/up, ``[down_cols, depth]`` for down; with
    ``tiles.gate_up_one_dot`` the routed gate/up one is ``[2 experts, I, H]`` with block
    ``[2, gate_up_cols, depth]``. Without a shared expert its slots hold routed descriptors of
    the shared tiles' blocks, which the kernel then never reads.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .tma_promotion import promote

    def described(weight: torch.Tensor, block: list[int]):
        return promote(TensorDescriptor.from_tensor(weight, block), tiles.weight_l2_promotion)

    gu, dn = experts.gate_up_proj, experts.down_proj
    gu_block, dn_block = [tiles.gate_up_cols, tiles.depth], [tiles.down_cols, tiles.depth]
    w_gu_rows = described(gu.detach().view(-1, gu.shape[-1]), gu_block)
    w_gu = w_gu_rows
    if tiles.gate_up_one_dot:
        # [2 E, I, H], block [2, gate_up_cols, depth]: an expert's gate and up blocks of the
        # same columns in one copy (tile_gemm.gate_up_pair_acc_tma).
        w_gu = described(gu.detach().view(-1, gu.shape[-2] // 2, gu.shape[-1]), [2, *gu_block])
    w_dn = described(dn.detach().view(-1, dn.shape[-1]), dn_block)
    if shared_mlp is None:
        return w_gu, w_dn, w_gu_rows, w_gu_rows, w_dn
    return (w_gu, w_dn, described(shared_mlp.gate_proj.weight.detach(), gu_block),
            described(shared_mlp.up_proj.weight.detach(), gu_block),
            described(shared_mlp.down_proj.weight.detach(), dn_block))


# What a training forward keeps of the gate and up projections (the backward kernel's SAVED):
# nothing, the rows below a cap in the forward's row order, or every row.
SAVED_NONE, SAVED_SOME, SAVED_ALL = 0, 1, 2


def saved_mode(save_gate_up: float, world: int) -> int:
    """The backward's ``SAVED`` mode: with one rank, a cap of ``T K`` rows holds every received row."""
    if save_gate_up == 0:
        return SAVED_NONE
    return SAVED_ALL if world == 1 else SAVED_SOME


@dataclasses.dataclass
class SavedGateUp:
    """The gate and up projections a training forward keeps for its backward, on the expert rank.

    ``values`` ``[rows, 2I]`` holds ``[x Wg^T | x Wu^T]`` of the first ``rows`` received rows in
    the forward's row order (the activation dtype); ``slots`` maps each (source rank, token,
    choice) to its row in that order, so the backward, which lays rows out in token order,
    finds them. With one rank every row is kept (``T K`` rows); with several, the rank may
    receive up to ``W T min(K, E/W)`` rows, so only ``save_gate_up * T K`` are kept and the
    backward recomputes the projections of row tiles holding any other.

    ``shared``, when the layer has shared experts and keeps theirs (``save_shared``), is
    ``[T, 2 I_s]``: ``[x Wg^T | x Wu^T]`` of every token, from which their backward
    (:func:`kosmos_moe.experts.shared_experts_backward`) takes its gradients without
    redoing their forward.

    ``logits`` ``[max(T, 1), E]`` fp32 are the router's logits of the source rank's tokens
    (nothing is written with no tokens), which the backward's route-backward tasks read
    instead of redoing the router GEMM (``4 E`` bytes per token; redoing it took most of those
    tasks' time, and reread the router weight once per ``route_tokens`` tokens).
    """

    values: torch.Tensor
    slots: torch.Tensor
    rows: int
    shared: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class _HostRecords:
    """A process-wide ring of pinned error-record slots, allocated once.

    Pinned host memory is allocated before the first launch and never freed, because
    allocating or freeing it while a persistent kernel waits for a peer that has not launched
    yet could stall the host behind that kernel.
    """

    SLOTS = 1024
    _table: torch.Tensor | None = None
    _free: list[int] = []

    @classmethod
    def reserve(cls) -> None:
        if cls._table is None:
            cls._table = torch.zeros(cls.SLOTS, _ERROR_WORDS, dtype=torch.int32, pin_memory=True)
            cls._free = list(range(cls.SLOTS))

    @classmethod
    def take(cls) -> int | None:
        cls.reserve()
        return cls._free.pop() if cls._free else None

    @classmethod
    def give(cls, slot: int) -> None:
        cls._free.append(slot)


class ExpertLayerTimeout(RuntimeError):
    """A fused kernel gave up waiting for a peer; the world's workspaces are no longer usable."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Inside ``_compile_together``: the warm-up compiles started so far, loaded at its end.
_compiling: list | None = None
# One launcher per persistent kernel: Triton's binding of its ~100 arguments costs each call
# host time before the launch (kosmos_moe.direct_launch).
_direct: dict = {}


def _load(compiled) -> None:
    compiled = compiled.result() if hasattr(compiled, "result") else compiled  # a compile in flight
    if compiled is not None:
        compiled._init_handles()  # cuModuleLoad + cuModuleGetFunction now, not at first launch


def _run(kernel, args, kwargs, grid, warmup: bool, what: str = "", check=None) -> None:
    """Launch ``kernel``, or with ``warmup`` compile it and load its module without launching.

    ``check(compiled)`` runs before the first launch of each compiled variant on the GPU."""
    if not warmup:
        if log.isEnabledFor(logging.DEBUG):
            stream = torch.cuda.current_stream().stream_id if torch.cuda.is_available() else 0
            log.debug("%.6f launch %s stream %d", time.perf_counter(), what, stream)
        if interpreter_active():
            kernel[grid](*args, **kwargs)
        else:
            if kernel not in _direct:
                _direct[kernel] = DirectLauncher(kernel)
            _direct[kernel](grid, args, kwargs, check)
        return
    compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    if _compiling is not None:
        _compiling.append(compiled)
    else:
        _load(compiled)


@contextmanager
def _compile_together(threads: int = 4):
    """Compile the kernels warmed up inside on a thread pool at once, then load them all.

    A layer warms up its two persistent kernels (forward, backward); one after another the
    three variants a layer with a shared expert once had took ~27 s per shape, on a pool ~16 s
    (sm_90, measured on a CPU). Without Triton's asynchronous compile mode, one by one.
    """
    global _compiling
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None
    if AsyncCompileMode is None or _compiling is not None:
        yield
        return
    started = _compiling = []
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool, AsyncCompileMode(pool):
            yield
    finally:
        _compiling = None
    for compiled in started:
        _load(compiled)


class _PersistentLaunch:
    """What the forward and backward launchers share: workers, workspace, timeouts, profile."""

    direction = ""
    profile_slots: tuple[str, ...] = ()

    def __init__(self, config: MoEConfig, fabric: Fabric, max_tokens: int, workers: int | None,
                 tiles, wait_bound: int | None, profile: bool, pool: WorkspacePool | None = None) -> None:
        self.config = config
        self.fabric = fabric
        self.max_tokens = max_tokens
        self.pool = pool
        on_gpu = fabric.device.type == "cuda"
        if not on_gpu and not interpreter_active():
            raise RuntimeError(
                "backend='kosmos' on the CPU runs its kernel under Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before importing kosmos_moe"
            )
        self.tiles = tiles
        limit = fabric.max_workers(tiles.workers_per_sm)
        if workers is not None and on_gpu and not 1 <= workers <= limit:
            raise ValueError(
                f"workers_per_rank={workers} must be in [1, {limit}]: more workers than can be resident "
                "would strand waiting workers"
            )
        if workers is not None and workers < 1:  # the interpreter runs any number, one after another
            raise ValueError(f"workers_per_rank must be at least 1, got {workers}")
        self.workers = workers or limit
        # Every rank on this device runs the same grid: all of them must be resident at once.
        self.residency_check = functools.partial(
            require_resident, programs=self.workers * fabric.ranks_per_device,
            what=f"{self.direction} kernel, rank {fabric.rank}") if on_gpu else None
        if wait_bound is not None and wait_bound < 1:
            raise ValueError(f"wait_bound must be a positive number of polls, got {wait_bound}")
        self.wait_bound = wait_bound or (GPU_WAIT_BOUND if on_gpu else INTERPRETER_WAIT_BOUND)
        self.layout: WorkspaceLayout | None = None
        self.workspace = None
        self._dtype = None
        self._pending: deque[tuple[torch.cuda.Event, int]] = deque()
        self._constexprs: dict[tuple, dict] = {}
        self._descriptors: tuple[tuple, tuple] | None = None  # (the weights' addresses, dtypes, shapes, strides; descriptors)
        self.failed: ExpertLayerTimeout | None = None
        # With profile=True (GPU only), every call adds per-task-kind nanoseconds and counts
        # here; see the kernel module's PROFILE_SLOTS.
        if profile and not on_gpu:
            raise ValueError("profiling reads the GPU timer; it is not available under the interpreter")
        self.profile = self.new_profile() if profile else None

    def _layout(self, dtype: torch.dtype) -> WorkspaceLayout:
        raise NotImplementedError

    def prepare(self, dtype: torch.dtype) -> None:
        """Build the workspace (collective over the fabric); call before CUDA graph capture."""
        if self.layout is not None:
            if dtype != self._dtype:
                raise TypeError(
                    f"the fused workspace was built for {self._dtype}, got {dtype}: a fused layer runs in one dtype "
                    "(under torch.autocast an fp32 layer runs in autocast's dtype, so call it always or never "
                    "under autocast, or keep it in that dtype)"
                )
            return
        self._dtype = dtype
        self.layout = self._layout(dtype)
        if self.pool is not None:
            self.workspace = self.pool.workspace(self.fabric, self.layout, self.direction)
            if self.workspace.failed is not None:  # another layer's call left it inconsistent
                self.failed = self.workspace.failed
                self._raise_failed()
        else:
            self.workspace = self.fabric.workspace(self.layout.nbytes)
        self._words = self.workspace.local[: 4 * self.layout.words["words"]].view(torch.int32)

    def _common_constexprs(self, dtype: torch.dtype, on_gpu: bool | None = None) -> dict:
        # Built once per (dtype, device kind): every call launches with them, and rebuilding
        # the dict of some sixty entries took 14 us a call (CPU host, Python 3.11).
        key = (dtype, on_gpu)
        if key not in self._constexprs:
            self._constexprs[key] = self._build_constexprs(dtype, on_gpu)
        return self._constexprs[key]

    def _targets_gpu(self, on_gpu: bool | None) -> bool:
        """Whether the kernel is built for the GPU (else for the interpreter); ``on_gpu``
        overrides the fabric's device (benchmarks/kernel_resources.py)."""
        return self.fabric.device.type == "cuda" if on_gpu is None else on_gpu

    def _build_constexprs(self, dtype: torch.dtype, on_gpu: bool | None) -> dict:
        import triton.language as tl

        c, lay = self.config, self.layout
        world = self.fabric.world_size
        interp = not self._targets_gpu(on_gpu)
        return dict(
            H=c.hidden_size, I=c.moe_intermediate_size, E=c.num_experts, E_L=c.num_experts // world,
            TOP_K=c.top_k, W=world, T_MAX=self.max_tokens, TILE_CAP=lay.tile_cap,
            SIGMOID_GROUP=c.router == "sigmoid_group", NORM_TOPK=c.norm_topk_prob,
            ROUTER_PRECISION="ieee" if interp else "tf32x3",
            **lay.kernel_args(),
            E_PAD=max(16, _next_pow2(c.num_experts)), EL_PAD=_next_pow2(c.num_experts // world),
            W_PAD=_next_pow2(world), K_PAD=_next_pow2(c.top_k), O_PAD=_next_pow2(c.num_experts),
            DOT_DTYPE=tl.float32 if (interp or dtype == torch.float32) else tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
            SCOPE=self.fabric.signal_scope,
        )

    def _token_problem(self, tokens: torch.Tensor) -> str | None:
        """Why this rank's call cannot run on ``tokens`` (too many, wrong device), or None.

        Callers join the call's collectives (the first call's workspace and barrier) before
        raising it: a rank that raised before them would leave its peers blocked in a
        collective without a bound, where after them its peers' kernels time out waiting for
        its launch and raise an error naming it.
        """
        n = tokens.shape[0]
        if n > self.max_tokens:
            return (f"{n} tokens on rank {self.fabric.rank}, but the layer was built for max_tokens_per_rank="
                    f"{self.max_tokens}; rebuild it with a larger bound")
        if tokens.device != self.fabric.device:
            return f"tokens are on {tokens.device}, the fabric of this layer on {self.fabric.device}"
        return None

    def _mark_refused(self, problem: str) -> None:
        """In a world of several ranks, a call refused on this rank is launched by its peers
        without it: they time out, and their half-finished exchange is in this rank's workspace.
        So this layer stays failed as theirs do (world 1 just refuses the call)."""
        if self.fabric.world_size > 1:
            self._fail(ExpertLayerTimeout(
                f"rank {self.fabric.rank} of {self.fabric.world_size} refused a {self.direction} call ({problem}); "
                "its peers launched without it and time out. The workspaces of this world are now inconsistent: "
                "rebuild the layers."
            ))

    def _fail(self, error: ExpertLayerTimeout) -> None:
        """Remember ``error`` here and on the workspace, which other launchers may share."""
        self.failed = error
        if self.workspace is not None:
            self.workspace.failed = error

    def new_profile(self) -> torch.Tensor:
        """A zeroed profile buffer: 16 per-kind nanosecond slots, 16 pass counts, then each
        worker's start and exit of the last profiled call (``kernels.profile.PROFILE_SPANS``).
        Assign it to ``profile`` to start counting afresh."""
        from kosmos_moe.kernels.profile import SPANS_AT

        return torch.zeros(SPANS_AT + 2 * self.workers, dtype=torch.int64, device=self.fabric.device)

    def profile_report(self) -> dict[str, dict[str, float]]:
        """Per task kind: worker-seconds spent and passes, summed over the profiled calls."""
        if self.profile is None:
            raise RuntimeError("build the launcher with profile=True")
        from kosmos_moe.kernels.profile import SPANS_AT

        values = self.profile[:SPANS_AT].cpu().tolist()
        return {
            kind: {"seconds": values[i] * 1e-9, "passes": values[16 + i]} for i, kind in enumerate(self.profile_slots)
        }

    def worker_spans_us(self) -> torch.Tensor:
        """Each worker's [start, exit] in the last profiled call, in microseconds from the first
        worker's start: a ``[workers, 2]`` float64 tensor on the CPU."""
        if self.profile is None:
            raise RuntimeError("build the launcher with profile=True")
        from kosmos_moe.kernels.profile import SPANS_AT

        spans = self.profile[SPANS_AT:].cpu().view(self.workers, 2)
        if bool((spans == 0).any()):
            raise RuntimeError("no profiled call has run since the profile buffer was made")
        return (spans - spans[:, 0].min()).double() * 1e-3

    # ------------------------------------------------------------------------------------
    # Timeouts: the kernel leaves an error record in the workspace; the host reads it without
    # stalling the stream (a pinned copy checked when its event has completed).

    def _watch(self) -> None:
        record = self._words[16: 16 + _ERROR_WORDS]
        if self.fabric.device.type != "cuda":
            self._check(record.tolist())
            return
        if torch.cuda.is_current_stream_capturing():
            return  # under graph capture, raise_if_failed(block=True) reads the record itself
        # With no slot free (a thousand calls in flight) the record stays in the workspace for a
        # blocking check.
        slot = _HostRecords.take()
        if slot is not None:
            _HostRecords._table[slot].copy_(record, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.workspace.last_use = (torch.cuda.current_stream().cuda_stream, event)
        if slot is not None:
            self._pending.append((event, slot))

    def _after_other_streams(self) -> None:
        """Make this call's stream wait for the last call that used this workspace from another
        stream (``Workspace.last_use``, set by :meth:`_watch` on a GPU only).

        Layers that share a workspace (:func:`kosmos_moe.share_workspaces`), or one layer called
        from two streams, would otherwise run kernels that overwrite each other's buffers. The
        wait is the device's; the host goes on. Under CUDA graph capture the streams' order is
        the graph's, as captured.
        """
        use = self.workspace.last_use
        if use is None or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream()
        if use[0] != stream.cuda_stream:
            stream.wait_event(use[1])

    def raise_if_failed(self, block: bool = True) -> None:
        """Raise :class:`ExpertLayerTimeout` if any earlier call timed out.

        With ``block`` it waits for the calls in flight; otherwise it looks only at those that
        have finished. Every call does the non-blocking check first.
        """
        if self.failed is None and self.workspace is not None and self.workspace.failed is not None:
            self.failed = self.workspace.failed  # a call of another launcher sharing the workspace
        if self.failed is not None:
            self._raise_failed()
        if self.fabric.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if block and self.workspace is not None:
            if self.fabric.device.type == "cuda":
                torch.cuda.synchronize(self.fabric.device)
            self._check(self._words[16: 16 + _ERROR_WORDS].tolist())
        records = []
        # Oldest first, stopping at the first call still running: the calls of a stream finish
        # in order, and a look at every call in flight per call costs a query each (a host
        # running far ahead would pay for all of them every call).
        while self._pending:
            event, slot = self._pending[0]
            if block:
                event.synchronize()
            elif not event.query():
                break
            self._pending.popleft()
            # A list, not a clone: cloning a pinned tensor allocates pinned memory (cProfile of
            # 20 Qwen3 forwards on the H200: 26 of 40 ms in 7 clones).
            records.append(_HostRecords._table[slot].tolist())
            _HostRecords.give(slot)
        for record in records:
            self._check(record)

    def _raise_failed(self) -> NoReturn:
        # A new exception each time: raising the stored one would attach a traceback whose
        # frames hold this launcher, a cycle that keeps its workspaces (GiBs on a GPU) alive
        # until a garbage collection.
        raise ExpertLayerTimeout(*self.failed.args)

    def _check(self, record: list[int]) -> None:
        kind, rank, task, peer, index, expected, observed, _ = (int(v) for v in record)
        if kind == 0:
            return
        if kind == _ERR_SHORT:
            self._fail(ExpertLayerTimeout(
                f"combine on rank {rank} was given {observed} expert-output rows, but {expected} rows were "
                "dispatched to it; nothing was combined and this exchange's workspaces are no longer consistent"
            ))
            self._raise_failed()
        what = _WHAT.get(kind, f"signal kind {kind}").format(
            peer=peer, index=index, expected=expected, observed=observed, task=task
        )
        self._fail(ExpertLayerTimeout(
            f"kosmos {self.direction} on rank {rank} of {self.fabric.world_size} timed out after {self.wait_bound} polls "
            f"waiting for {what}. A peer may not have launched its {self.direction}, or launched a different one. "
            "The workspaces of this world are now inconsistent: rebuild the layers."
            + (_EMULATED_HINT if isinstance(self.fabric, EmulatedFabric) and self.fabric.world_size > 1 else "")
        ))
        self._raise_failed()


def check_fused_options(options: dict) -> None:
    """Refuse ``ExpertLayer(fused_options=...)`` keys that :class:`FusedForward` does not take, at
    the layer's construction rather than at its first call."""
    fixed = {"self", "config", "fabric", "max_tokens", "workers"}  # the layer passes these itself
    known = sorted(set(inspect.signature(FusedForward.__init__).parameters) - fixed)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown fused_options {unknown}; the kosmos launcher takes {known}")


class FusedForward(_PersistentLaunch):
    """Launches the persistent forward kernel for one rank of one layer.

    The workspace is requested from the fabric on the first call (a collective: every rank
    must call) and reused by every later call; no call waits on the host, so after the first
    eager call the layer can be captured in a CUDA graph. With ``backward=True`` the
    backward's workspace is requested at the same time, so that a rank's first backward never
    allocates while its peers' kernels run. ``save_gate_up`` sets how many received rows'
    gate/up projections a training call keeps, per (token, choice) of this rank's batch
    (:class:`SavedGateUp`); with one rank every row is kept, and 0 keeps none. With
    ``save_shared`` a training call also keeps the shared experts' projections (``2 I_s``
    values per token), so that their backward redoes no forward GEMM; without, it recomputes
    their forward.
    """

    direction = "forward"

    def __init__(
        self,
        config: MoEConfig,
        fabric: Fabric,
        max_tokens: int,
        workers: int | None = None,
        tiles: Tiles | None = None,
        wait_bound: int | None = None,
        profile: bool = False,
        backward: bool = False,
        backward_tiles: BackwardTiles | None = None,
        save_gate_up: float = 1.25,
        save_shared: bool = True,
        workspace_pool: WorkspacePool | None = None,
    ) -> None:
        on_gpu = fabric.device.type == "cuda"
        super().__init__(config, fabric, max_tokens, workers, tiles or (GPU_TILES if on_gpu else INTERPRETER_TILES),
                         wait_bound, profile, workspace_pool)
        from kosmos_moe.kernels.expert_forward import PROFILE_SLOTS

        if not save_gate_up >= 0:
            raise ValueError(f"save_gate_up must be >= 0 (0 keeps nothing), got {save_gate_up}")
        self.profile_slots = PROFILE_SLOTS
        self._warm = False
        self.save_gate_up = save_gate_up
        self.save_shared = save_shared
        self.backward = FusedBackward(config, fabric, max_tokens, workers, backward_tiles, wait_bound, profile,
                                      saved=saved_mode(save_gate_up, fabric.world_size), pool=workspace_pool)
        self.backward_at_prepare = backward

    def _layout(self, dtype: torch.dtype) -> WorkspaceLayout:
        return forward_layout(self.config, self.fabric.world_size, self.max_tokens, self.tiles, dtype)

    def prepare(self, dtype: torch.dtype) -> None:
        super().prepare(dtype)
        if self.backward_at_prepare:
            self.backward.prepare(dtype)

    def __call__(
        self, tokens: torch.Tensor, layer: nn.Module, keep_routing: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Run the layer's forward on ``tokens`` ``[T, H]``; return the output and top-k ids.

        The shared experts, if the layer has them, are part of the launch. With
        ``keep_routing`` it also returns what the backward needs: copies of the int32 choices
        and fp32 weights ``[T, K]``, and the kept gate/up projections (:class:`SavedGateUp`).
        """
        self.raise_if_failed(block=False)
        problem = self._token_problem(tokens)
        if problem is not None:
            self.join_refused_call(layer, keep_routing, problem)
            raise ValueError(problem)
        n, hidden = tokens.shape
        self.prepare(tokens.dtype)
        tokens = tokens.contiguous()
        out = torch.empty(max(n, 1), hidden, dtype=tokens.dtype, device=self.fabric.device)
        if self.fabric.device.type == "cuda":
            _HostRecords.reserve()
            self._join_first_launch(tokens if n > 0 else out, out, layer, keep_routing)
        saved = self._saved_gate_up(n, tokens.dtype, layer.shared_experts is not None) if keep_routing else None
        self._after_other_streams()
        self._launch(tokens if n > 0 else out, out, n, layer, warmup=False, saved=saved)
        lay, c = self.layout, self.config
        top_e = self._words[lay.words["topk_e"]: lay.words["topk_e"] + n * c.top_k].view(n, c.top_k)
        out = out if n else out[:0]  # the buffer itself, not a view of it (FSDP2 warns on views)
        if keep_routing:
            w0 = lay.bytes["topk_w"]
            top_w = self.workspace.local[w0: w0 + 4 * n * c.top_k].view(torch.float32).view(n, c.top_k)
            result = (out, top_e.long(), top_e.clone(), top_w.clone(), saved)
        else:
            result = (out, top_e.long())
        self._watch()  # after the copies out of the workspace: the end of this call's use of it
        return result

    def _join_first_launch(self, x: torch.Tensor, out: torch.Tensor, layer: nn.Module, keep_routing: bool) -> None:
        """On a GPU, the first call (and the first training call) compiles and loads this
        rank's kernels, then waits for every rank to have done so (a barrier)."""
        # A training forward also readies its backward: a layer that first ran without grad
        # would otherwise compile and allocate at its first backward, with peers waiting.
        with_backward = self.backward_at_prepare or keep_routing
        if not self._warm or (with_backward and not self.backward.warm):
            self._warm_up(x, out, layer, with_backward)
            # Ranks compile at their own pace; their first launches start together.
            self.fabric.barrier()

    def join_refused_call(self, layer: nn.Module, keep_routing: bool, problem: str) -> None:
        """Do what this rank's peers do at this call before they launch, for a call this rank
        refuses: the first call's workspace collective and, on a GPU, its warm-up barrier. A rank
        that raised before them would leave its peers blocked in a collective without a bound;
        after them its peers' kernels time out waiting for its launch and raise an error naming
        it. The layer then stays failed (:meth:`_mark_refused`)."""
        dtype, device = layer.experts.gate_up_proj.dtype, self.fabric.device  # the layer's dtype (the gate may be fp32)
        self.prepare(dtype)
        if device.type == "cuda":
            stand_in = torch.zeros(1, self.config.hidden_size, dtype=dtype, device=device)
            self._join_first_launch(stand_in, torch.empty_like(stand_in), layer, keep_routing)
        self._mark_refused(problem)

    def _saved_gate_up(self, n: int, dtype: torch.dtype, has_shared: bool) -> SavedGateUp:
        """Buffers for the gate/up projections a training call keeps (see :class:`SavedGateUp`)."""
        c, world, mode = self.config, self.fabric.world_size, self.backward.saved
        # Rows kept, and slots indexed by (source rank, token, choice). A backward that may read
        # the slots reads them whole, even where the forward kept no row (rows 0).
        if mode == SAVED_NONE:
            rows = slots = 0
        elif mode == SAVED_ALL:  # one rank: every row it receives is one of its own choices
            rows = slots = n * c.top_k
        else:
            rows = min(self.layout.recv_rows, math.ceil(self.save_gate_up * n * c.top_k))
            slots = world * self.max_tokens * c.top_k
        device = self.fabric.device
        values = torch.empty(max(rows, 1), 2 * c.moe_intermediate_size, dtype=dtype, device=device)
        shared = None
        if has_shared and self.save_shared:
            shared = torch.empty(n, 2 * c.shared_intermediate_size, dtype=dtype, device=device)
        logits = torch.empty(max(n, 1), c.num_experts, dtype=torch.float32, device=device)
        return SavedGateUp(values, torch.empty(max(slots, 1), dtype=torch.int32, device=device), rows, shared, logits)

    def _warm_up(self, x: torch.Tensor, out: torch.Tensor, layer: nn.Module, with_backward: bool) -> None:
        """Compile and load every kernel variant this layer may launch, before launching any.

        Loading a module while a peer's persistent kernel spins may wait for that kernel (CUDA
        lazy loading serialises them), and the peer waits for this rank: so the forward and the
        backward are both loaded before this rank's first launch.
        """
        self._warm_host_path(x.device, x.dtype, with_backward)
        with _compile_together():
            if not self._warm:
                self._launch(x, out, x.shape[0], layer, warmup=True)
            if with_backward and not self.backward.warm:
                self.backward.warm_up(x, layer)
        self._warm = True

    def _warm_host_path(self, device: torch.device, dtype: torch.dtype, with_backward: bool) -> None:
        """Run once what a call does on the host around its launch that is slow the first time.

        In an emulated world the first rank's kernel spins until its peers launch, and the host
        launches them one after another: a first-time cost on that path stalls the whole world
        (H200: 4 s between rank 0's forward and its backward, rank 0 timed out). Two such costs
        were seen: loading the module of a torch kernel (CUDA loads modules lazily, and a load
        waits for the running kernels) and autograd importing sympy at the first backward.
        """
        from .balance import tokens_per_expert

        choices = torch.zeros(1, self.config.top_k, dtype=torch.int32, device=device)
        tokens_per_expert(choices, self.config.num_experts)
        choices.long(), choices.clone(), choices.float().clone()  # the forward's returned choices and weights
        if with_backward:
            choices.float().to(dtype)  # the router gradient, accumulated in fp32, cast to the weight's dtype
            importlib.import_module("torch.fx.experimental.symbolic_shapes")  # autograd's _make_grads imports it lazily

    def _launch(self, x, out, n, layer, warmup: bool, saved: SavedGateUp | None = None) -> None:
        _run(*self.kernel_call(x, out, n, layer, saved=saved), grid=(self.workers,), warmup=warmup,
             what=f"forward rank {self.fabric.rank} tokens {n} shared {layer.shared_experts is not None}",
             check=self.residency_check)

    def _weight_descriptors(self, experts: nn.Module, shared_mlp: nn.Module | None) -> tuple:
        """``weight_descriptors``, rebuilt only when a weight moved or changed dtype or shape (an
        optimizer's in-place update keeps the descriptors valid)."""
        weights = [experts.gate_up_proj, experts.down_proj]
        if shared_mlp is not None:
            weights += [shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight, shared_mlp.down_proj.weight]
        if not all(isinstance(w, nn.Parameter) for w in weights):
            # Per-call casts (an fp32 layer under autocast): a cached descriptor would keep the
            # call's copy of the weights alive until the next call, and never match again.
            return weight_descriptors(experts, shared_mlp, self.tiles)
        key = tuple((w.data_ptr(), w.dtype, w.shape, w.stride()) for w in weights)
        if self._descriptors is None or self._descriptors[0] != key:
            self._descriptors = (key, weight_descriptors(experts, shared_mlp, self.tiles))
        return self._descriptors[1]

    def kernel_call(self, x, out, n, layer, on_gpu: bool | None = None, saved: SavedGateUp | None = None) -> tuple:
        """``(kernel, args, constants)`` of the launch for ``n`` tokens; ``on_gpu`` overrides the
        fabric's device in the compile-time choices (benchmarks/kernel_resources.py); ``saved``
        receives the gate/up projections of a training call."""
        from kosmos_moe.kernels.expert_forward import expert_forward_kernel

        c, t = self.config, self.tiles
        gate, experts = layer.gate, layer.experts
        shared_mlp = layer.shared_experts
        bias = gate.e_score_correction_bias
        dummy = self.workspace.local
        tma = tma_usable(t, c, x.dtype, x.device)
        weights = (
            experts.gate_up_proj, experts.down_proj,
            shared_mlp.gate_proj.weight if shared_mlp is not None else dummy,
            shared_mlp.up_proj.weight if shared_mlp is not None else dummy,
            shared_mlp.down_proj.weight if shared_mlp is not None else dummy,
        )
        # Without saving, typed stand-ins: the same compiled kernel serves both kinds of call.
        kept = (saved.values, saved.slots, saved.rows) if saved is not None else (out, self._words, 0)
        shared_kept = saved is not None and saved.shared is not None and n > 0
        kept += (saved.shared, 1) if shared_kept else (out, 0)
        # The logits' stand-in is fp32 too (a pointer's dtype is part of the compiled kernel).
        kept += (saved.logits, 1) if saved is not None and n > 0 else (self._words[:1].view(torch.float32), 0)
        args = (
            x, out, n, *kept,
            gate.weight, bias if bias is not None else dummy, float(c.routed_scaling_factor),
            *weights,
            *(self._weight_descriptors(experts, shared_mlp) if tma else weights),
            self.workspace.peers, self.fabric.rank, self.wait_bound,
            self.profile if self.profile is not None else self.workspace.peers,
        )
        kwargs = dict(
            **self._common_constexprs(x.dtype, on_gpu),
            I_S=c.shared_intermediate_size if shared_mlp is not None else 0,
            N_GROUP=c.n_group, TOPK_GROUP=c.topk_group, G_PAD=_next_pow2(c.n_group),
            **t.kernel_constants(c.num_experts // self.fabric.world_size), TMA=tma,
            PROFILE=self.profile is not None,
            # Rows read in place from x and received rows (256-byte aligned workspace) all
            # start 16-byte aligned: the kernel may tell the compiler so.
            ROWS_ALIGNED=(t.row_alignment_hint and x.data_ptr() % 16 == 0
                          and c.hidden_size * x.element_size() % 16 == 0),
        )
        return expert_forward_kernel, args, kwargs

    def raise_if_failed(self, block: bool = True) -> None:
        """Raise :class:`ExpertLayerTimeout` if an earlier forward or backward call timed out."""
        super().raise_if_failed(block)
        self.backward.raise_if_failed(block)


class FusedBackward(_PersistentLaunch):
    """Launches the persistent backward kernel for one rank of one layer (routed experts).

    It needs from the forward the input, the forward's choices, weights and router logits, and
    the gate/up projections it kept (:class:`SavedGateUp`); the dispatch layout is rebuilt from
    the choices, so any number of forwards may run before their backwards. Its workspace is
    separate from the forward's. ``saved`` (the kernel's ``SAVED``) says which rows' projections
    the forward keeps; with none, the SwiGLU-backward tasks are ``recompute_cols`` wide.
    """

    direction = "backward"

    def __init__(self, config, fabric, max_tokens, workers=None, tiles=None, wait_bound=None, profile=False,
                 saved: int = SAVED_NONE, rows_only: bool = False, pool: WorkspacePool | None = None) -> None:
        on_gpu = fabric.device.type == "cuda"
        if tiles is None:
            if not on_gpu:
                tiles = INTERPRETER_BACKWARD_TILES
            elif rows_only:  # a standalone dispatch/combine moves rows only: one worker per SM
                tiles = GPU_BACKWARD_TILES
            else:
                tiles = gpu_backward_tiles(config.num_experts // fabric.world_size, keeps_every_row=saved == SAVED_ALL)
        if saved == SAVED_NONE:
            # Every SwiGLU-backward task redoes the projections: no wider tasks.
            tiles = dataclasses.replace(tiles, swiglu_cols=tiles.recompute_cols)
        super().__init__(config, fabric, max_tokens, workers, tiles, wait_bound, profile, pool)
        from kosmos_moe.kernels.expert_backward import PROFILE_SLOTS

        self.profile_slots = PROFILE_SLOTS
        self.saved = saved
        self.rows_only = rows_only  # a standalone dispatch/combine: no gradient buffers (backward_layout)
        self.warm = False  # compiled and loaded for this layer (warm_up)

    def _build_constexprs(self, dtype: torch.dtype, on_gpu: bool | None) -> dict:
        # Where the backward's GEMM operands come from: decided once per (dtype, target), as
        # every other compile-time constant, not on every launch.
        t = self.tiles
        tma = backward_tma_usable(self.config, dtype, self.fabric.device)
        return dict(
            super()._build_constexprs(dtype, on_gpu),
            WG_TMA=t.wgrad_tma and tma, WG_TMA_STORE=t.wgrad_tma and t.wgrad_tma_store and tma,
            TILE_TMA=t.tile_tma and tma,
            # The interpreter has no inline assembly, and no proxies to order.
            PROXY_FENCE=self._targets_gpu(on_gpu),
        )

    def _layout(self, dtype: torch.dtype) -> WorkspaceLayout:
        return backward_layout(self.config, self.fabric.world_size, self.max_tokens, self.tiles, dtype,
                               rows_only=self.rows_only)

    def __call__(
        self, tokens: torch.Tensor, grad_out: torch.Tensor, top_e: torch.Tensor, top_w: torch.Tensor,
        saved: SavedGateUp, router_weight: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(grad_x, grad_router_weight (fp32), grad_gate_up_proj, grad_down_proj)``."""
        self.raise_if_failed(block=False)
        problem = self._token_problem(tokens) or self._logits_problem(tokens, saved)
        n, hidden = tokens.shape
        self.prepare(tokens.dtype)
        if problem is not None:
            self._mark_refused(problem)
            raise ValueError(problem)
        c = self.config
        tokens = tokens.contiguous()
        grad_out = grad_out.to(tokens.dtype).contiguous()
        dx = torch.empty(max(n, 1), hidden, dtype=tokens.dtype, device=tokens.device)
        d_router = torch.empty(router_weight.shape, dtype=torch.float32, device=tokens.device)
        d_gate_up = torch.empty_like(gate_up_proj)
        d_down = torch.empty_like(down_proj)
        if self.fabric.device.type == "cuda":
            _HostRecords.reserve()
        if n == 0:  # typed stand-ins keep the one compiled kernel of every rank
            tokens, grad_out = dx, dx
            top_e = torch.zeros(1, c.top_k, dtype=torch.int32, device=dx.device)
            top_w = torch.zeros(1, c.top_k, dtype=torch.float32, device=dx.device)
        self._after_other_streams()
        self._launch(tokens, grad_out, dx, top_e, top_w, n, saved, router_weight, gate_up_proj, down_proj,
                     d_router, d_gate_up, d_down, warmup=False)
        self._watch()
        return dx[:n], d_router, d_gate_up, d_down

    def _logits_problem(self, tokens: torch.Tensor, saved: SavedGateUp) -> str | None:
        """Why ``saved`` lacks the router logits this call reads (see :class:`SavedGateUp`), or None."""
        want = (max(tokens.shape[0], 1), self.config.num_experts)
        logits = saved.logits
        if logits is not None and tuple(logits.shape) == want and logits.dtype == torch.float32:
            return None
        got = None if logits is None else f"{tuple(logits.shape)} {logits.dtype}"
        return (f"the backward reads the forward's fp32 router logits, {want} (SavedGateUp.logits, kept by a "
                f"training forward); got {got}")

    def warm_up(self, x: torch.Tensor, layer: nn.Module) -> None:
        """Compile and load the backward kernel for this layer's tensors (see FusedForward._warm_up)."""
        if self.fabric.device.type != "cuda":
            return
        self.prepare(x.dtype)
        self.warm = True
        c = self.config
        top_e = torch.zeros(1, c.top_k, dtype=torch.int32, device=x.device)
        top_w = torch.zeros(1, c.top_k, dtype=torch.float32, device=x.device)
        w = layer.gate.weight
        gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
        d_router = torch.empty(w.shape, dtype=torch.float32, device=x.device)
        saved = SavedGateUp(x, top_e.view(-1), 0, logits=top_w)
        self._launch(x, x, x, top_e, top_w, 0, saved, w, gu, dn, d_router, gu, dn, warmup=True)

    def _launch(self, tokens, grad_out, dx, top_e, top_w, n, saved, router_weight, gate_up_proj, down_proj,
                d_router, d_gate_up, d_down, warmup: bool) -> None:
        call = self.kernel_call(tokens, grad_out, dx, top_e, top_w, n, saved, router_weight, gate_up_proj, down_proj,
                                d_router, d_gate_up, d_down)
        if (call[2]["WG_TMA"] or call[2]["TILE_TMA"]) and tokens.device.type == "cuda":
            ensure_triton_allocator()
        _run(*call, grid=(self.workers,), warmup=warmup, what=f"backward rank {self.fabric.rank} tokens {n}",
             check=self.residency_check)

    def kernel_call(self, tokens, grad_out, dx, top_e, top_w, n, saved, router_weight, gate_up_proj, down_proj,
                    d_router, d_gate_up, d_down, on_gpu: bool | None = None) -> tuple:
        """``(kernel, args, constants)`` of the launch (see FusedForward.kernel_call)."""
        from kosmos_moe.kernels.expert_backward import expert_backward_kernel

        c, t = self.config, self.tiles
        args = (
            tokens, grad_out, dx, top_e, top_w, saved.logits, n, saved.values, saved.slots, saved.rows,
            router_weight, float(c.routed_scaling_factor), gate_up_proj, down_proj,
            d_router, d_gate_up, d_down,
            self.workspace.peers, self.fabric.rank, self.wait_bound,
            self.profile if self.profile is not None else self.workspace.peers,
        )
        kwargs = dict(
            **self._common_constexprs(tokens.dtype, on_gpu), **t.kernel_constants(c.hidden_size),
            PROFILE=self.profile is not None, SAVED=self.saved,
        )
        return expert_backward_kernel, args, kwargs


class FusedExpertsFunction(torch.autograd.Function):
    """Autograd over the fused kernels: the whole layer forward in one launch, the routed
    experts and router backward in one launch, the shared experts' backward recomputed.

    The forward launch runs before ``apply`` (``launched`` is its result, the shared experts
    included). The backward launches the fused kernel first, then recomputes the shared
    experts' forward under autograd and takes their gradients, so that no GEMM sits on a
    rank's stream between its two fused launches. In an emulated world (every rank on one GPU)
    the shared experts' cuBLAS kernels there, while the peers' persistent kernels spun waiting
    for that rank's backward, stalled a world of 4 with a shared expert on the H200, whether
    queued before the backward launch or after the forward launch (EmulatedWorld's docs).

    Saved between the two: the input (which autograd keeps for the caller anyway), the
    forward's int32 choices and fp32 routing weights (``8 K`` bytes per token), its fp32 router
    logits (``4 E`` bytes per token), the gate and up projections of the routed rows
    (:class:`SavedGateUp`: ``2I`` values per row, and an int32 slot per (source, token,
    choice)), those of the shared experts (``2 I_s`` values per token, unless ``save_shared``
    is off) and the weights themselves (no copies). Both SwiGLU
    activations are recomputed from the projections; the shared experts' backward then runs
    six GEMMs instead of autograd's nine (three of them its forward again). Without their
    projections it recomputes their forward under autograd.
    """

    # Positions in forward's inputs (ctx.needs_input_grad): the routed parameters and the
    # first shared weight.
    ROUTED = slice(4, 7)
    SHARED = 7

    @staticmethod
    def forward(ctx, tokens, launched: tuple, launcher: FusedForward, shared_mlp: nn.Module | None,
                router_weight, gate_up_proj, down_proj, *shared_weights):
        out, top_e, top_e32, top_w, saved = launched
        ctx.launcher, ctx.shared_mlp, ctx.saved_rows = launcher, shared_mlp, saved.rows
        ctx.save_for_backward(tokens, router_weight, gate_up_proj, down_proj, top_e32, top_w, saved.logits,
                              saved.values, saved.slots, saved.shared, *shared_weights)
        ctx.mark_non_differentiable(top_e)
        return out, top_e

    @staticmethod
    def backward(ctx, grad_out, _grad_top_e):
        (tokens, router_weight, gate_up_proj, down_proj, top_e, top_w, logits, kept, slots, shared_kept,
         *shared_weights) = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = d_router = d_gate_up = d_down = None
        # Only the shared experts train (routed experts and router frozen, input without
        # grad): no launch. Every rank of a world runs the same model, so all skip together.
        if need[0] or any(need[FusedExpertsFunction.ROUTED]):
            dx, d_router, d_gate_up, d_down = ctx.launcher.backward(
                tokens, grad_out, top_e, top_w, SavedGateUp(kept, slots, ctx.saved_rows, logits=logits),
                router_weight, gate_up_proj, down_proj,
            )
            d_router = d_router.to(router_weight.dtype)
        d_shared = [None] * len(shared_weights)
        need_shared = list(need[FusedExpertsFunction.SHARED:])
        # shared_weights are the tensors of ctx.shared_mlp.parameters() in order at the forward
        # (ExpertLayer._kosmos_forward); the module may hold others now (autocast's copies).
        names = [name for name, _ in ctx.shared_mlp.named_parameters()] if ctx.shared_mlp is not None else []
        if shared_kept is not None and (any(need_shared) or need[0]):
            dx, grads = shared_experts_backward(dict(zip(names, shared_weights)), tokens, grad_out, shared_kept, dx,
                                                need[0], dict(zip(names, need_shared)))
            d_shared = [grads.get(name) for name in names]
        elif any(need_shared) or (need[0] and shared_weights):
            with torch.enable_grad():
                x = tokens.detach().requires_grad_(need[0])
                y = torch.func.functional_call(ctx.shared_mlp, dict(zip(names, shared_weights)), (x,))
                wrt = [t for t, n in zip([x, *shared_weights], [need[0], *need_shared]) if n]
                got = iter(torch.autograd.grad(y, wrt, grad_out.to(y.dtype)))
            if need[0]:
                dx = dx + next(got)
            d_shared = [next(got) if n else None for n in need_shared]
        return (dx, None, None, None, d_router, d_gate_up, d_down, *d_shared)
