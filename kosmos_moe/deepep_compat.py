"""DeepEP's normal-mode Python API over kosmos-moe's dispatch and combine.

``Buffer`` takes the same arguments and returns the same values as ``deep_ep.Buffer`` for
intranode normal-mode dispatch and combine, so that DeepEP call sites run unchanged:

    buffer = Buffer(group, num_nvl_bytes=int(1e9))
    n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w)

Semantics follow DeepEP: ``recv_x`` holds each token once per destination rank, grouped by
source rank in token order; ``recv_topk_idx`` holds local expert ids (-1 where the expert
lives elsewhere), ``recv_topk_weights`` the matching weights (0 elsewhere); combine sums the
rows of each token over the ranks it went to, and sums ``topk_weights`` likewise.

Where it differs from DeepEP:

* Dispatch synchronises with the host once, like DeepEP's normal mode, to size ``recv_x`` and
  build ``num_recv_tokens_per_expert_list``; the kernels themselves never wait on the host.
* Each dispatch and combine is one persistent launch per tensor (rows, then indices and
  weights) on the current stream, with no communication stream: ``async_finish`` returns an
  event that is already ordered on the current stream, and ``allocate_on_comm_stream=True``
  is refused.
* There is no SM split to tune: ``config`` and ``set_num_sms`` are accepted and have no effect
  (a warning says so once).
* The buffer is sized by ``max_tokens_per_rank`` (default 4096 tokens per rank), not by
  ``num_nvl_bytes``; a call with more tokens raises ``ValueError``.
* Not supported, with an error: FP8 ``(x, scales)`` inputs, low-latency mode, RDMA
  (internode) buffers, ``num_worst_tokens``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from .exchange import DispatchHandle, ExpertExchange
from .fabric import Fabric, default_fabric


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()`` orders the current stream after it."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class Config:
    """Accepted for compatibility: kosmos-moe has no SM split or chunk sizes to tune."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class Handle(NamedTuple):
    """DeepEP's intranode handle layout; fields kosmos-moe has no counterpart for are None."""

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: None
    recv_channel_prefix_matrix: None
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: None
    rank_idx: torch.Tensor          # kosmos-moe: each token's destination ranks (-1 padded)
    layout: int                     # kosmos-moe: which dispatch layout this handle describes
    num_recv: int


_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"kosmos_moe.deepep_compat: {what} has no effect (no SM split to tune)", stacklevel=3)


def _event(async_finish: bool) -> EventOverlap:
    if async_finish and torch.cuda.is_available():
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)
    return EventOverlap()


class Buffer:
    """DeepEP-compatible communication buffer for intranode normal-mode dispatch and combine."""

    num_sms: int = 0

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, max_tokens_per_rank: int = 4096,
                 fabric: Fabric | None = None) -> None:
        if low_latency_mode:
            raise NotImplementedError("kosmos_moe.deepep_compat.Buffer implements normal mode only, not low-latency mode")
        if num_rdma_bytes:
            raise NotImplementedError("kosmos_moe.deepep_compat.Buffer is intranode only: pass num_rdma_bytes=0")
        self.group = group
        self.fabric = fabric
        if fabric is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            self.fabric = default_fabric(group, device)
        self.rank = self.fabric.rank
        self.group_size = self.fabric.world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.max_tokens_per_rank = max_tokens_per_rank
        self._rows: ExpertExchange | None = None
        self._meta: ExpertExchange | None = None
        self._shape: tuple | None = None
        self._layouts = 0
        # The layout each exchange's workspace holds now, and that layout's exchange handle.
        self._rows_state: tuple[int, DispatchHandle] | None = None
        self._meta_state: tuple[int, DispatchHandle] | None = None

    # DeepEP's static tuning knobs.
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        _warn_once("Buffer.set_num_sms")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config()

    def capture(self) -> EventOverlap:
        return _event(True)

    def destroy(self) -> None:
        self._rows = self._meta = None

    # ------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Return ``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)``."""
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} does not divide over {self.group_size} ranks")
        valid = topk_idx >= 0
        experts = torch.where(valid, topk_idx, 0).long()
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        per_expert.scatter_add_(0, experts.reshape(-1), valid.reshape(-1).to(torch.int32))
        ranks = torch.where(valid, experts // (num_experts // self.group_size), self.group_size)
        # One column past the last rank collects the empty choices and is dropped.
        hits = torch.zeros(topk_idx.shape[0], self.group_size + 1, dtype=torch.int32, device=topk_idx.device)
        hits.scatter_add_(1, ranks, torch.ones_like(ranks, dtype=torch.int32))
        in_rank = hits[:, : self.group_size] > 0
        per_rank = in_rank.sum(0, dtype=torch.int32)
        return per_rank, None, per_expert, in_rank, _event(async_finish)

    def _check_stream_args(self, previous_event, allocate_on_comm_stream) -> None:
        if allocate_on_comm_stream:
            raise NotImplementedError("kosmos-moe has no communication stream: allocate_on_comm_stream=True is not supported")
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _exchanges(self, hidden: int, dtype: torch.dtype, top_k: int, num_experts: int) -> None:
        shape = (hidden, dtype, top_k, num_experts)
        if self._shape is None:
            slots = min(top_k, self.group_size)
            self._rows = ExpertExchange(self.group_size, slots, hidden, self.max_tokens_per_rank, self.fabric)
            self._meta = ExpertExchange(self.group_size, slots, 2 * top_k, self.max_tokens_per_rank, self.fabric)
            self._shape = shape
        elif shape != self._shape:
            raise ValueError(f"this Buffer moves (hidden, dtype, top_k, num_experts)={self._shape}, got {shape}; "
                             "build another Buffer for another shape")

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Return ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``."""
        if isinstance(x, tuple):
            raise NotImplementedError("FP8 dispatch ((x, scales) inputs) is not supported by kosmos_moe.deepep_compat")
        if num_worst_tokens:
            raise NotImplementedError("num_worst_tokens is not supported by kosmos_moe.deepep_compat")
        if num_tokens_per_rdma_rank is not None:
            raise NotImplementedError("kosmos_moe.deepep_compat is intranode only (num_tokens_per_rdma_rank must be None)")
        if config is not None:
            _warn_once("config")
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        W = self.group_size
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights, as in DeepEP")
            rank_idx, num_experts, top_k = handle.rank_idx, self._shape[3], self._shape[2]
        else:
            if is_token_in_rank is None:
                raise ValueError("dispatch needs is_token_in_rank (from get_dispatch_layout) or a handle")
            if topk_idx is None:
                raise ValueError("kosmos_moe.deepep_compat dispatch needs topk_idx and topk_weights for a new layout")
            num_experts = int(num_tokens_per_expert.numel()) if num_tokens_per_expert is not None else None
            if num_experts is None:
                raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) to know the expert count")
            top_k = topk_idx.shape[1]
            slots = min(top_k, W)
            ranks = torch.arange(W, device=x.device)
            order = torch.where(is_token_in_rank, ranks, W).sort(dim=1).values[:, :slots]
            rank_idx = torch.where(order < W, order, -1)
        self._exchanges(x.shape[1], x.dtype, top_k, num_experts)
        layout = handle.layout if handle is not None else self._layouts + 1
        self._layouts = max(self._layouts, layout)
        slot_w = torch.ones(rank_idx.shape, dtype=torch.float32, device=x.device)
        rows, rows_handle = self._rows.dispatch(x, rank_idx, slot_w)
        self._rows_state = (layout, rows_handle)
        num_recv = int(rows_handle.num_rows)  # the host sync of normal mode: it sizes recv_x
        recv_x = rows[:num_recv].clone()  # DeepEP's recv_x outlives the next dispatch; the receive buffer does not
        if handle is not None:
            return recv_x, None, None, None, handle, _event(async_finish)
        meta_in = torch.cat([topk_idx.to(torch.float32), topk_weights.to(torch.float32)], dim=1)
        meta, meta_handle = self._meta.dispatch(meta_in, rank_idx, slot_w)
        self._meta_state = (layout, meta_handle)
        local = num_experts // W
        first = self.rank * local
        table = self._rows._view("table", torch.int32, 2 * W * W).view(2, W, W)[self._rows._calls % 2]
        rank_prefix = table.cumsum(0, dtype=torch.int32)
        recv_src_idx = (rows_handle.source_index[:num_recv] // min(top_k, W)).to(torch.int32)
        m = meta[:num_recv]
        glob = m[:, :top_k].round().long()
        mine = (glob >= first) & (glob < first + local)
        recv_topk_idx = torch.where(mine, glob - first, -1)
        recv_topk_weights = torch.where(mine, m[:, top_k:], 0.0)
        counts = torch.stack([(recv_topk_idx == e).sum() for e in range(local)])
        counts = ((counts + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        new = Handle(rank_prefix, None, None, recv_src_idx, is_token_in_rank, None, rank_idx, layout, num_recv)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, new, _event(async_finish)

    def _state(self, exchange: ExpertExchange, state, handle: Handle, width: int, dtype: torch.dtype):
        """The exchange handle of ``handle``'s layout, re-laying it out if another dispatch ran since."""
        if state is not None and state[0] == handle.layout:
            return state[1]
        n = handle.rank_idx.shape[0]
        device = handle.rank_idx.device
        _, fresh = exchange.dispatch(torch.zeros(n, width, dtype=dtype, device=device), handle.rank_idx,
                                     torch.ones(handle.rank_idx.shape, dtype=torch.float32, device=device))
        return fresh

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None,
                bias=None, config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Return ``(combined_x, combined_topk_weights, event)``: sums over the ranks each token went to."""
        if bias is not None:
            raise NotImplementedError("combine bias is not supported by kosmos_moe.deepep_compat")
        if config is not None:
            _warn_once("config")
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        if x.shape[0] != handle.num_recv:
            raise ValueError(f"combine takes one row per received token ({handle.num_recv}), got {x.shape[0]}")
        hidden, dtype, top_k, _ = self._shape
        rows_handle = self._state(self._rows, self._rows_state, handle, hidden, dtype)
        self._rows_state = (handle.layout, rows_handle)
        rows = x if x.shape[0] else torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device)
        combined = self._rows.combine(rows, rows_handle, weighted=False)
        combined_w = None
        if topk_weights is not None:
            meta_handle = self._state(self._meta, self._meta_state, handle, 2 * top_k, torch.float32)
            self._meta_state = (handle.layout, meta_handle)
            payload = torch.zeros(max(x.shape[0], 1), 2 * top_k, dtype=torch.float32, device=x.device)
            payload[: x.shape[0], top_k:] = topk_weights.float()
            combined_w = self._meta.combine(payload, meta_handle, weighted=False)[:, top_k:]
        return combined, combined_w, _event(async_finish)
