"""Standalone dispatch and combine on the fused layer's kernels and fabric.

``dispatch`` sends each token's row to the ranks of its chosen experts and returns the rows
this rank received in expert-major order, with a handle; ``combine`` sends expert outputs
back along the handle and folds each token's results (weighted by its routing weights). Both
are one persistent launch per rank with no host synchronisation: the received rows come back
in a buffer sized for the worst case, with the real counts as device tensors.

    ex = ExpertExchange(num_experts=256, top_k=8, hidden_size=7168, max_tokens_per_rank=4096,
                        fabric=SymmetricMemoryFabric(group))
    rows, handle = ex.dispatch(x, topk_idx, topk_weights)   # rows: [handle.capacity, H]
    y = my_experts(rows, handle.tokens_per_expert)            # same order as rows
    out = ex.combine(y, handle)                               # [T, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEConfig
from .fabric import Fabric
from .fused import FusedBackward, _HostRecords
from .workspace import PINNED_OPTIONS


@dataclass
class DispatchHandle:
    """The layout of one dispatch call; valid until the next dispatch on the same exchange.

    ``tokens_per_expert`` (int64 ``[E_local]``, device) counts the rows received per local
    expert; rows are grouped by local expert, then by source rank, then by source token.
    ``source_rank`` and ``source_index`` (``token * top_k + k``) and ``weights`` describe each
    received row; entries past ``num_rows`` are stale.
    """

    tokens_per_expert: torch.Tensor
    source_rank: torch.Tensor
    source_index: torch.Tensor
    weights: torch.Tensor
    topk_idx: torch.Tensor
    num_tokens: int
    call: int

    @property
    def num_rows(self) -> torch.Tensor:
        """Rows received, as a device scalar (reading it on the host synchronises)."""
        return self.tokens_per_expert.sum()


class ExpertExchange:
    """Dispatch and combine of one expert-parallel world, over one fabric and workspace."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, max_tokens_per_rank: int,
                 fabric: Fabric, workers: int | None = None, wait_bound: int | None = None) -> None:
        if num_experts % fabric.world_size:
            raise ValueError(f"num_experts={num_experts} does not divide over {fabric.world_size} ranks")
        # The exchange moves rows only; the expert width is irrelevant to it.
        self.config = MoEConfig(hidden_size=hidden_size, moe_intermediate_size=16, num_experts=num_experts, top_k=top_k)
        self.launch = FusedBackward(self.config, fabric, max_tokens_per_rank, workers, wait_bound=wait_bound,
                                    rows_only=True)
        self.launch.direction = "dispatch/combine"
        self.fabric = fabric
        self._calls = 0
        self._dtype = None

    @property
    def capacity(self) -> int:
        """Rows the receive buffer holds: ``W * T * min(K, E / W)``."""
        return self.launch.layout.recv_rows

    def _view(self, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        lay, ws = self.launch.layout, self.launch.workspace.local
        if name in lay.words:
            return ws[4 * lay.words[name]: 4 * (lay.words[name] + count)].view(torch.int32)
        start = lay.bytes[name]
        size = torch.tensor([], dtype=dtype).element_size()
        return ws[start: start + size * count].view(dtype)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, DispatchHandle]:
        """Send rows of ``x`` ``[T, H]`` to the experts in ``topk_idx`` ``[T, K]`` (-1: none).

        The returned rows are a view of the receive buffer: valid until the next dispatch.
        """
        from kosmos_moe.kernels.expert_backward import expert_backward_kernel

        c, launch = self.config, self.launch
        n = x.shape[0]
        if x.dim() != 2 or x.shape[1] != c.hidden_size:
            raise ValueError(f"x must be [tokens, {c.hidden_size}], got {tuple(x.shape)}")
        if topk_idx.shape != (n, c.top_k) or topk_weights.shape != (n, c.top_k):
            raise ValueError(f"topk_idx and topk_weights must be [{n}, {c.top_k}], got "
                             f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")
        if self._dtype is not None and x.dtype != self._dtype:
            raise TypeError(f"this exchange moves {self._dtype} rows, got {x.dtype}")
        launch.raise_if_failed(block=False)
        problem = launch._token_problem(x)
        launch.prepare(x.dtype)  # the first call's collective, joined before refusing a call
        if problem is not None:
            launch._mark_refused(problem)
            raise ValueError(problem)
        self._dtype = x.dtype
        t = launch.tiles
        top_e = topk_idx.to(torch.int32).contiguous()
        top_w = topk_weights.to(torch.float32).contiguous()
        if n == 0:
            x = torch.zeros(1, c.hidden_size, dtype=x.dtype, device=x.device)
            top_e = torch.full((1, c.top_k), -1, dtype=torch.int32, device=x.device)
            top_w = torch.zeros(1, c.top_k, dtype=torch.float32, device=x.device)
        if self.fabric.device.type == "cuda":
            _HostRecords.reserve()
        dummy = launch.workspace.peers
        consts = launch._common_constexprs(x.dtype)
        expert_backward_kernel[(launch.workers,)](
            x.contiguous(), x, x, top_e, top_w, top_w, n, x, top_e, 0, dummy, 1.0, dummy, dummy, dummy, dummy, dummy,
            launch.workspace.peers, self.fabric.rank, launch.wait_bound, dummy,
            **consts, **t.kernel_constants(c.hidden_size), PROFILE=False, MODE=1,
        )
        launch._watch()
        self._calls += 1
        W, E, L = self.fabric.world_size, c.num_experts, c.num_experts // self.fabric.world_size
        par = self._calls % 2
        table = self._view("table", torch.int32, 2 * W * E).view(2, W, W, L)[par, :, self.fabric.rank]
        R = launch.layout.recv_rows
        handle = DispatchHandle(
            tokens_per_expert=table.sum(0, dtype=torch.int64),
            source_rank=self._view("recv_src", torch.int32, R),
            source_index=self._view("recv_ent", torch.int32, R),
            weights=self._view("recv_w", torch.float32, R),
            topk_idx=top_e, num_tokens=n, call=self._calls,
        )
        rows = self._view("recv_x", x.dtype, R * c.hidden_size).view(R, c.hidden_size)
        return rows, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = True) -> torch.Tensor:
        """Return ``out[t] = sum_k w[t, k] * y[row of (t, k)]`` (``weighted=False``: without ``w``).

        ``y`` holds one output row per received row, in the dispatch's order (at least
        ``handle.num_rows`` rows; the receive buffer's shape always suffices). Fewer rows make
        the kernel stop with an error record rather than read past ``y``.
        """
        from kosmos_moe.kernels.combine import combine_kernel

        c, launch = self.config, self.launch
        if handle.call != self._calls:
            raise RuntimeError("this handle belongs to an earlier dispatch; combine answers the latest one only")
        if y.dim() != 2 or y.shape[1] != c.hidden_size or y.shape[0] < 1:
            raise ValueError(f"y must be [rows, {c.hidden_size}] in the dispatch's row order, got {tuple(y.shape)}")
        if y.dtype != self._dtype:
            raise TypeError(f"combine moves {self._dtype} rows (the dispatch's dtype), got {y.dtype}")
        launch.raise_if_failed(block=False)
        n = handle.num_tokens
        out = torch.empty(max(n, 1), c.hidden_size, dtype=y.dtype, device=y.device)
        lay, t = launch.layout, launch.tiles
        consts = launch._common_constexprs(y.dtype)
        combine_kernel[(launch.workers,)](
            y.contiguous(), y.shape[0], out, handle.topk_idx, n, launch.workspace.peers, self.fabric.rank, launch.wait_bound,
            H=c.hidden_size, E=c.num_experts, E_L=consts["E_L"], TOP_K=c.top_k, W=self.fabric.world_size,
            T_MAX=launch.max_tokens, C_TABLE=lay.words["table"], C_COMB_ARR=lay.words["comb_arr"],
            C_RECV_SRC=lay.words["recv_src"], C_RECV_ENT=lay.words["recv_ent"],
            B_RECV_W=lay.bytes["recv_w"], B_COMB=lay.bytes["comb"],
            BM=t.dispatch_rows, BH=t.dispatch_cols, BTF=t.fold_tokens, BHF=t.fold_cols,
            W_PAD=consts["W_PAD"], EL_PAD=consts["EL_PAD"], K_PAD=consts["K_PAD"],
            SCOPE=self.fabric.signal_scope, WEIGHTED=weighted, num_warps=t.warps, **PINNED_OPTIONS,
        )
        launch._watch()
        return out[:n]
