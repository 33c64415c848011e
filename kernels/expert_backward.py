"""The persistent backward kernel of the expert layer: one launch per rank, like the forward.

The forward leaves each token's choice (``topk_e``) and routing weights (``topk_w``); the
backward rebuilds the dispatch layout from them. A training forward also keeps, on the expert
rank, the gate and up projections of its received rows (``saved_ptr``, in the forward's row
order, ``slot_ptr`` mapping (source, token, choice) to that order), up to ``save_cap`` rows;
the SwiGLU activation is recomputed from them. With ``g = grad_out`` and, for the row of
(token t, choice k) on expert e, ``w`` its routing weight:

    y    = silu(x Wg^T) * (x Wu^T) @ Wd^T          (never stored)
    dh'  = g Wd            dw_k = <g, y_k> = <dh', h>        dh = w dh'
    dg   = dh * u * silu'(a)   du = dh * silu(a)   with a = x Wg^T, u = x Wu^T
    dx   = [dg du] [Wg; Wu]     dWd = sum_rows g^T (w h)     dW[g;u] = sum_rows [dg du]^T x

Task queues (priority order: the consumer closest to grad_x first)
-------------------------------------------------------------------
FOLD      one per block of BTF local tokens: ``grad_x[t] = sum_k dx[t, k] + dx_router[t]``.
          Ready when every dx block and the router part of the block's tokens have arrived.
DX        (local expert, H-block, row tile): ``dx = [dg du] @ [Wg; Wu]`` over depth 2I; the
          epilogue stores each row into its source rank's combine buffer. The H-block-0 task
          also sums the row's ``dw`` partials (fixed order) and sends ``dw`` to the source.
          Ready when all SwiGLU-backward tiles of the row tile are done.
RBWD      route backward of BT local tokens: reads the fp32 router logits the forward kept
          (``logits_ptr``; redoing the router GEMM here read the whole router weight once per
          task), takes ``dw`` through the top-k rule to ``d logits`` (kept for DWR) and adds
          ``d logits @ Wr`` as the router's part of grad_x. Ready when every ``dw`` of its
          tokens has arrived.
DH        (local expert, I-block, row tile): one pass over H computes ``dh'``; the gate and
          up projections are read where the forward kept them, or, for a tile with a row it
          did not keep, recomputed in the same pass (three accumulators, in sub-tiles of BN_RC
          columns). The epilogue writes
          ``w h``, ``[dg du]`` and the row's partial ``dw``. Ready when every source has
          delivered that expert's rows.
FEED      claimed without a readiness check, in order: layout tiles (histogram of the
          choices of BT tokens per expert), the count exchange (tile prefix sums, counts to
          every peer), send-list tiles (each (token, k) at its token-ordered place in its
          expert's send list), then dispatch chunks (x rows and g rows of one (destination,
          expert) in receiver order). Token order makes the row order of every expert, and so
          every reduction below, the same from run to run. Rows bound for this rank are
          copied too (the forward reads them in place): the weight-gradient reductions step
          through rows, and gathered row reads there (an index load feeding each step's
          addresses) kept the compiler from pipelining the loop (sm_90 TTGIR: a full wait on
          every copy each step).
DWGU, DWD (local expert, row block, strip of ``WS`` column blocks) of ``dW[g;u]`` and ``dWd``:
          each output tile reduces over all of the expert's rows in slot order
          (deterministic, no atomics); each block of a strip is its own pipelined loop
          (``WG_BLOCK_LOOPS``; else one flat loop over the strip), its operands read by TMA
          where the launcher allows (``WG_TMA``: descriptors over the expert's rows, made in
          the task; on the GPU an async-proxy fence follows the readiness acquire,
          since the rows were stored in this launch through the generic proxy). Ready when
          every SwiGLU-backward tile of the expert is done; experts without rows write zeros.
DWR       (expert block, H-block) of the router weight's gradient, ``d logits^T x`` over the
          local tokens in order, BRK at a time, in BRM x BRN tiles of fp32 operands. Ready
          when every route-backward tile is done.

Claiming and why it cannot deadlock: as in the forward (kernels.expert_forward). FOLD, DH,
DX, RBWD, DWGU/DWD (one ticket for both, dW[g;u] first) and DWR are taken by ticket and run
when ready, FEED by fetch-and-add. No worker waits on a ticket it holds. Only FEED tasks spin, each on FEED tasks before it in some rank's queue (count
exchange on this rank's layout tiles; send-list tiles on this rank's count exchange; dispatch
chunks on every rank's count exchange and this rank's send lists). Readiness follows
FEED < DH < DX < RBWD < FOLD and DH < DWGU, DWD; RBWD < DWR, one topological order over all
ranks, so the earliest unfinished task is always running, held by a worker that runs it at
its next pass, or claimable, with any number of workers per rank.

Epochs, parity, the error record and the reset by the last worker work as in the forward.
"""

import triton
import triton.language as tl

from .profile import now, record_worker_span
from .queues import (
    claim, combine_destination, count_flags, dispatch_chunk, expert_tasks, fold_block, locate, pick, poll_counts,
    record_missing_counts,
)
from .route import router_dot, routing_backward
from .signals import (
    ERR_COMBINE, ERR_DH_EXPERT, ERR_DH_TILE, ERR_DW, ERR_LAYOUT, ERR_ROWS,
    async_proxy_fence, peer_ptr, record_error, signal_add,
)
from .tile_gemm import column_halves, row_reduction_strip, rows_times_weight_tile, swiglu_backward_tile

PROFILE_SLOTS = ("idle", "layout", "count_exchange", "dispatch", "swiglu_backward", "dx",
                 "route_backward", "fold", "weight_grad", "router_weight_grad",
                 "swiglu_backward_epilogue", "dx_epilogue", "weight_grad_epilogue")
# Parts of the kept-projection SwiGLU-backward, dx and weight-gradient tasks' time above (not
# passes of their own): from the tile's last dot to the end of its stores and signals (weight
# gradients: to the issue of each block's store).
PROFILE_DH_EPILOGUE = tl.constexpr(PROFILE_SLOTS.index("swiglu_backward_epilogue"))
PROFILE_DX_EPILOGUE = tl.constexpr(PROFILE_SLOTS.index("dx_epilogue"))
PROFILE_WG_EPILOGUE = tl.constexpr(PROFILE_SLOTS.index("weight_grad_epilogue"))

Q_FEED = tl.constexpr(0)
Q_DH = tl.constexpr(1)
Q_DX = tl.constexpr(2)
Q_RBWD = tl.constexpr(3)
Q_FOLD = tl.constexpr(4)
Q_DWGU = tl.constexpr(5)
Q_DWD = tl.constexpr(6)
Q_DWR = tl.constexpr(7)
# Bit ``1 << q`` of a worker's ``open_q`` stands for queue ``q`` (see kernels.expert_forward).
OPEN_FEED, OPEN_DH, OPEN_DX, OPEN_RBWD, OPEN_FOLD, OPEN_DWGU, OPEN_DWD, OPEN_DWR = (
    tl.constexpr(1 << q.value) for q in (Q_FEED, Q_DH, Q_DX, Q_RBWD, Q_FOLD, Q_DWGU, Q_DWD, Q_DWR))
ALL_OPEN = tl.constexpr(OPEN_FEED | OPEN_DH | OPEN_DX | OPEN_RBWD | OPEN_FOLD | OPEN_DWGU | OPEN_DWD | OPEN_DWR)

# What the forward kept for the SwiGLU backward (``SAVED``): nothing (every DH tile redoes
# the gate and up projections), some rows (those below ``save_cap`` in the forward's row
# order; a tile with any other row redoes them), or every row.
SAVED_NONE = tl.constexpr(0)
SAVED_SOME = tl.constexpr(1)
SAVED_ALL = tl.constexpr(2)

C_EPOCH = tl.constexpr(0)
C_EXIT = tl.constexpr(1)
C_ABORT = tl.constexpr(2)
C_LAYOUT_A = tl.constexpr(3)   # layout tiles done
C_PREFIX = tl.constexpr(4)     # 1 once the count exchange wrote the tile prefix sums
C_LAYOUT_B = tl.constexpr(5)   # send-list tiles done
C_RB_DONE = tl.constexpr(6)    # route-backward tiles done
C_HEADS = tl.constexpr(8)
C_ERR = tl.constexpr(16)


@triton.jit
def _wait_at_least(ptr, target, wait_bound, SCOPE: tl.constexpr):
    """Poll ``ptr`` (acquire) until it reaches ``target`` or the bound runs out; return the last value."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    polls = 0
    while (seen < target) & (polls <= wait_bound):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        polls += 1
    return seen


@triton.jit
def swiglu_backward_epilogue(dh1, a, u, wgt, r64, row_ok, n0, hw, dgu, I: tl.constexpr, BN: tl.constexpr):
    """Store ``w h`` and ``[dg du]`` of columns ``n0 : n0 + BN`` from ``dh'``, the gate and up
    projections and the routing weights; return each row's partial ``<dh', h>``."""
    DT = hw.dtype.element_ty
    cols = n0 + tl.arange(0, BN)
    m2 = row_ok[:, None] & (cols < I)[None, :]
    # Each value stored as soon as it is made: fewer whole tiles live at once. [dg du] before
    # w h: offline sm_90 (Triton 3.6) spills 972 B instead of 1,248 at the default tiles, 2,056
    # instead of 2,528 beside 128 x 256 weight-gradient tiles (DeepSeek-V3 one-rank view).
    sig = tl.sigmoid(a)
    silu = a * sig
    dh = dh1 * wgt[:, None]
    tl.store(dgu + r64 * (2 * I) + cols[None, :], (dh * u * (sig + silu * (1.0 - sig))).to(DT), mask=m2)
    tl.store(dgu + r64 * (2 * I) + I + cols[None, :], (dh * silu).to(DT), mask=m2)
    h = silu * u
    tl.store(hw + r64 * I + cols[None, :], (h * wgt[:, None]).to(DT), mask=m2)
    part = tl.sum(tl.where(m2, dh1 * h, 0.0), axis=1)
    return part


@triton.jit
def kept_projections(kept, row_ok, n0, I: tl.constexpr, BN: tl.constexpr):
    """The gate and up projections the forward kept (``kept``: one pointer per row) for
    columns ``n0 : n0 + BN``, in their stored dtype."""
    cols = n0 + tl.arange(0, BN)
    ok = row_ok[:, None] & (cols < I)[None, :]
    at = kept[:, None] + cols[None, :]
    return tl.load(at, mask=ok, other=0.0), tl.load(at + I, mask=ok, other=0.0)


@triton.jit
def kept_swiglu_backward(
    g_ptr, n_rows, w_down_ptr, kept, wgt, r64, row_ok, n0, hw, dgu,
    H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN_EPI: tl.constexpr,
    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
    PROFILE: tl.constexpr, profile_ptr,
):
    """A SwiGLU-backward tile whose rows' gate and up projections the forward kept (``kept``:
    one pointer per row): ``dh' = g @ Wd[:, n0:n0+BN]`` is its only GEMM. The epilogue runs in
    two column parts, so that fewer whole tiles are live at once (offline sm_90: 2,796 ->
    784 B of spills, H200: 2.94 -> 2.24 ms busy per worker, DeepSeek-V3 one-rank view), or in
    quarters where a quarter is still ``BN_EPI`` columns wide (256-column tiles beside per-block
    weight-gradient loops: 776 B of spills against 1,668 in halves). Each part reads its kept
    projections, gathered by row, after the previous part's stores: requesting them a part
    ahead made the backward 0.4-2.0% slower (H100 80GB, stop 50). Asking L2 for them (prefetch)
    before the GEMM made the epilogue slower where the GEMM is long (stop 36), and 8 or 16 steps
    before its loop ends (stop 53, H100 80GB) took the epilogue from 24.8 to 22.2 / 24.1 us at
    DeepSeek-V3 32 experts and left the step as long (17.83 / 17.89 / 17.97 ms): the loads'
    latency is not what the epilogue waits on."""
    dh1 = rows_times_weight_tile(g_ptr, n_rows, w_down_ptr, n0, H, I, BM, BN, BK, DOT_DTYPE, STAGES, TMA)
    t_epilogue = now() if PROFILE else 0
    lo, hi = column_halves(dh1, BM, BN // 2)
    if BN >= 4 * BN_EPI:
        q0, q1 = column_halves(lo, BM, BN // 4)
        q2, q3 = column_halves(hi, BM, BN // 4)
        parts = (q0, q1, q2, q3)
    else:
        parts = (lo, hi)
    N_PARTS: tl.constexpr = len(parts)
    BP: tl.constexpr = BN // N_PARTS
    a, u = kept_projections(kept, row_ok, n0, I, BP)
    part = tl.zeros([BM], dtype=tl.float32)
    for i in tl.static_range(N_PARTS):
        part += swiglu_backward_epilogue(parts[i], a.to(tl.float32), u.to(tl.float32), wgt, r64, row_ok,
                                         n0 + i * BP, hw, dgu, I, BP)
        if i + 1 < N_PARTS:
            a, u = kept_projections(kept, row_ok, n0 + (i + 1) * BP, I, BP)
    if PROFILE:
        tl.atomic_add(profile_ptr + PROFILE_DH_EPILOGUE, now() - t_epilogue, sem="relaxed")
    return part


@triton.jit
def recomputed_swiglu_backward(
    x_rows, g_rows, n_rows, w_gate_up_ptr, w_down_ptr, wgt, r64, row_ok, n0, hw, dgu,
    H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN_RC: tl.constexpr,
    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """A SwiGLU-backward tile that redoes the gate and up projections, as ``BN / BN_RC``
    sub-tiles of three accumulators each. They are unrolled: an outer loop around the pipelined
    one, zeroing accumulators in it, is what once made ptxas serialize every wgmma of the
    kernel (C7515)."""
    part = tl.zeros([BM], dtype=tl.float32)
    for sub in tl.static_range(BN // BN_RC):
        c0 = n0 + sub * BN_RC
        dh1, a, u = swiglu_backward_tile(x_rows, g_rows, n_rows, w_gate_up_ptr, w_gate_up_ptr + I * H, w_down_ptr,
                                         c0, H, I, BM, BN_RC, BK, DOT_DTYPE, STAGES)
        part += swiglu_backward_epilogue(dh1, a, u, wgt, r64, row_ok, c0, hw, dgu, I, BN_RC)
    return part


@triton.jit(do_not_specialize=["n_tokens", "me", "wait_bound", "save_cap"])
def expert_backward_kernel(
    x_ptr, g_ptr, dx_ptr, topk_e_ptr, topk_w_ptr, logits_ptr, n_tokens, saved_ptr, slot_ptr, save_cap,
    router_w_ptr, scale, w_gate_up_ptr, w_down_ptr,
    d_router_ptr, d_gate_up_ptr, d_down_ptr,
    peers_ptr, me, wait_bound, profile_ptr,
    H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, E_L: tl.constexpr, TOP_K: tl.constexpr,
    W: tl.constexpr, T_MAX: tl.constexpr, TILE_CAP: tl.constexpr,
    SIGMOID_GROUP: tl.constexpr, NORM_TOPK: tl.constexpr, ROUTER_PRECISION: tl.constexpr,
    C_TABLE: tl.constexpr, C_FLAG: tl.constexpr, C_ARRIVED: tl.constexpr, C_DH_DONE: tl.constexpr,
    C_DH_EXP: tl.constexpr, C_COMB_ARR: tl.constexpr, C_DW_ARR: tl.constexpr, C_HIST: tl.constexpr,
    C_TPOS: tl.constexpr, C_SEND_LIST: tl.constexpr, C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr,
    C_WORDS: tl.constexpr,
    B_RECV_W: tl.constexpr, B_DW_PART: tl.constexpr, B_DW_COMB: tl.constexpr, B_DLOGITS: tl.constexpr,
    B_RECV_X: tl.constexpr, B_RECV_G: tl.constexpr, B_HW: tl.constexpr, B_DGU: tl.constexpr,
    B_COMB: tl.constexpr,
    BT: tl.constexpr, BK_R: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
    BN_DH: tl.constexpr, BN_EPI: tl.constexpr, BN_RC: tl.constexpr, BN_DX: tl.constexpr, BK: tl.constexpr,
    BKW: tl.constexpr, BWM: tl.constexpr, BWN: tl.constexpr, WS: tl.constexpr, BRM: tl.constexpr, BRN: tl.constexpr,
    BRK: tl.constexpr, BHR: tl.constexpr,
    BTF: tl.constexpr, BHF: tl.constexpr, STAGES: tl.constexpr,
    DX_STAGES: tl.constexpr, WG_STAGES: tl.constexpr, RB_STAGES: tl.constexpr,
    E_PAD: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr,
    O_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SCOPE: tl.constexpr, PROFILE: tl.constexpr, MODE: tl.constexpr = 0,
    SAVED: tl.constexpr = 0, WG_TMA: tl.constexpr = False, TILE_TMA: tl.constexpr = False,
    PROXY_FENCE: tl.constexpr = False, WG_TMA_STORE: tl.constexpr = False, WG_BLOCK_LOOPS: tl.constexpr = False,
    WG_EVICT_FIRST: tl.constexpr = False,
):
    DT = x_ptr.dtype.element_ty
    SLOTS: tl.constexpr = TOP_K + 1                  # the router's part of grad_x is slot TOP_K
    N_IB: tl.constexpr = (I + BN_DH - 1) // BN_DH
    N_HB: tl.constexpr = (H + BN_DX - 1) // BN_DX
    EXPECT_PER_TOKEN: tl.constexpr = TOP_K * N_HB + 1
    PREFIX_ROWS: tl.constexpr = 32 if E_PAD <= 256 else 8   # an [rows, E_PAD] int32 block in registers
    N_WGU_M: tl.constexpr = (2 * I + BWM - 1) // BWM
    N_WGU_N: tl.constexpr = (H + BWN - 1) // BWN
    N_WD_M: tl.constexpr = (H + BWM - 1) // BWM
    N_WD_N: tl.constexpr = (I + BWN - 1) // BWN
    BKE: tl.constexpr = BK_R if BK_R < E_PAD else E_PAD  # experts per step of RBWD's d logits @ Wr
    N_EK: tl.constexpr = E_PAD // BKE
    N_HR: tl.constexpr = (H + BHR - 1) // BHR
    N_WR_M: tl.constexpr = (E + BRM - 1) // BRM
    N_WR_N: tl.constexpr = (H + BRN - 1) // BRN
    N_WGU_S: tl.constexpr = (N_WGU_N + WS - 1) // WS   # strips of WS column blocks per task
    N_WD_S: tl.constexpr = (N_WD_N + WS - 1) // WS
    n_dwgu = E_L * N_WGU_M * N_WGU_S
    n_dwd = E_L * N_WD_M * N_WD_S
    n_dwr = N_WR_M * N_WR_N

    ctl = peer_ptr(peers_ptr, me, 0, tl.int32)
    heads = ctl + C_HEADS
    err = ctl + C_ERR
    abort = ctl + C_ABORT
    recv_w = peer_ptr(peers_ptr, me, B_RECV_W, tl.float32)
    dw_part = peer_ptr(peers_ptr, me, B_DW_PART, tl.float32)
    dw_comb = peer_ptr(peers_ptr, me, B_DW_COMB, tl.float32)
    dlogits = peer_ptr(peers_ptr, me, B_DLOGITS, tl.float32)
    recv_x = peer_ptr(peers_ptr, me, B_RECV_X, DT)
    recv_g = peer_ptr(peers_ptr, me, B_RECV_G, DT)
    hw = peer_ptr(peers_ptr, me, B_HW, DT)
    dgu = peer_ptr(peers_ptr, me, B_DGU, DT)
    comb = peer_ptr(peers_ptr, me, B_COMB, DT)

    epoch = tl.load(ctl + C_EPOCH) + 1
    par = epoch % 2
    n_lt = tl.cdiv(n_tokens, BT)
    n_disp = tl.cdiv(n_tokens * TOP_K, BR) + E
    n_feed = 2 * n_lt + 1 + n_disp
    n_fold = tl.cdiv(n_tokens, BTF)

    w_idx = tl.arange(0, W_PAD)
    el_idx = tl.arange(0, EL_PAD)
    e_idx = tl.arange(0, E_PAD)
    kk = tl.arange(0, K_PAD)

    t_start = now() if PROFILE else 0
    running = 1
    idle = 0
    # Tickets this worker holds (-1: none); see kernels.expert_forward, "Claiming: tickets".
    held_dh = -1
    held_dx = -1
    held_rb = -1
    held_wg = -1
    held_wg_kind = 0
    held_wr = -1
    held_f = -1
    # Queues this worker still visits, and the counts once known: as in the forward.
    open_q = ALL_OPEN
    known = tl.sum(w_idx, axis=0) < 0  # false; a tensor, since it is carried by the loop
    flags = tl.zeros([W_PAD], dtype=tl.int32)
    n_el, tiles_el, tile_start_el, row_start_el, cum_dh, cum_dx, n_dh, n_dx = expert_tasks(
        tl.zeros([W_PAD, EL_PAD], dtype=tl.int32), BM, N_IB, N_HB)
    while running > 0:
        t_pass = now() if PROFILE else 0
        did = 0
        if known == 0:
            known, flags, table = poll_counts(ctl, epoch, par, me, W, W_PAD, E, E_L, EL_PAD, C_FLAG, C_TABLE, SCOPE)
            n_el, tiles_el, tile_start_el, row_start_el, cum_dh, cum_dx, n_dh, n_dx = expert_tasks(table, BM, N_IB, N_HB)

        # ---- FOLD ----
        if MODE == 0:
            # Looked at once the DX queue is taken to its end, as the forward's FOLD.
            f = held_f
            if (open_q & OPEN_DX) == 0:
                f, open_q = claim(heads + Q_FOLD, held_f, n_fold, open_q, OPEN_FOLD)
            if f >= 0:
                toks = f * BTF + tl.arange(0, BTF)
                tok_ok = toks < n_tokens
                got = tl.atomic_add(ctl + C_COMB_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
                if tl.sum(((got != EXPECT_PER_TOKEN) & tok_ok).to(tl.int32), axis=0) == 0:
                    tl.debug_barrier()
                    fold_block(comb, dx_ptr, toks, tok_ok, tok_ok, H, SLOTS, SLOTS, BTF, BHF, K_PAD, False)
                    did = 7
                    f = -1

            held_f = f

        # ---- DX ----
        if MODE == 0:
            if did == 0:
                q = held_dx
                if known:
                    q, open_q = claim(heads + Q_DX, held_dx, n_dx, open_q, OPEN_DX)
                if q >= 0:
                    e, first = locate(cum_dx, el_idx, q)
                    n_tiles_e = pick(tiles_el, el_idx, e)
                    local = q - first
                    hb = local // n_tiles_e
                    m = local % n_tiles_e
                    tile = pick(tile_start_el, el_idx, e) + m
                    if tl.atomic_add(ctl + C_DH_DONE + tile, 0, sem="acquire", scope="gpu") == N_IB:
                        tl.debug_barrier()
                        if PROXY_FENCE & TILE_TMA:
                            async_proxy_fence()
                        row0 = pick(row_start_el, el_idx, e) + m * BM
                        n_rows = tl.minimum(pick(n_el, el_idx, e) - m * BM, BM)
                        acc = rows_times_weight_tile(dgu + row0.to(tl.int64) * (2 * I), n_rows,
                                                     w_gate_up_ptr + e.to(tl.int64) * 2 * I * H, hb * BN_DX,
                                                     2 * I, H, BM, BN_DX, BK, DOT_DTYPE, DX_STAGES, TILE_TMA)
                        t_epilogue = now() if PROFILE else 0
                        rows = row0 + tl.arange(0, BM)
                        row_ok = tl.arange(0, BM) < n_rows
                        src = tl.load(ctl + C_RECV_SRC + rows, mask=row_ok, other=0)
                        ent = tl.load(ctl + C_RECV_ENT + rows, mask=row_ok, other=0)
                        dst_rows, base, tok = combine_destination(peers_ptr, src, ent, DT, TOP_K, SLOTS, H, B_COMB, W)
                        cols = hb * BN_DX + tl.arange(0, BN_DX)
                        tl.store(dst_rows[:, None] + cols[None, :], acc.to(DT),
                                 mask=row_ok[:, None] & (cols < H)[None, :])
                        if hb == 0:
                            ib = tl.arange(0, 16)
                            dw = tl.zeros([BM], dtype=tl.float32)
                            for i0 in tl.static_range(0, N_IB, 16):  # fixed order: deterministic
                                part = tl.load(dw_part + rows.to(tl.int64)[:, None] * N_IB + (i0 + ib)[None, :],
                                               mask=row_ok[:, None] & ((i0 + ib) < N_IB)[None, :], other=0.0)
                                dw += tl.sum(part, axis=1)
                            dw_dst = (base + B_DW_COMB + ent.to(tl.int64) * 4).to(tl.pointer_type(tl.float32))
                            tl.store(dw_dst, dw, mask=row_ok)
                        tl.debug_barrier()
                        arrive = (base + (C_COMB_ARR + tok).to(tl.int64) * 4).to(tl.pointer_type(tl.int32))
                        tl.atomic_add(arrive, 1, mask=row_ok, sem="release", scope=SCOPE)
                        if hb == 0:
                            dw_arrive = (base + (C_DW_ARR + tok).to(tl.int64) * 4).to(tl.pointer_type(tl.int32))
                            tl.atomic_add(dw_arrive, 1, mask=row_ok, sem="release", scope=SCOPE)
                        if PROFILE:
                            tl.atomic_add(profile_ptr + PROFILE_DX_EPILOGUE, now() - t_epilogue, sem="relaxed")
                        did = 5
                        q = -1
                held_dx = q

        # ---- RBWD ----
        if MODE == 0:
            if did == 0:
                r, open_q = claim(heads + Q_RBWD, held_rb, n_lt, open_q, OPEN_RBWD)
                if r >= 0:
                    toks = r * BT + tl.arange(0, BT)
                    tok_ok = toks < n_tokens
                    got = tl.atomic_add(ctl + C_DW_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
                    if tl.sum(((got != TOP_K) & tok_ok).to(tl.int32), axis=0) == 0:
                        tl.debug_barrier()
                        t64 = toks.to(tl.int64)
                        te = t64[:, None] * E + e_idx[None, :]  # [BT, E] rows: the logits' and d logits'
                        te_ok = tok_ok[:, None] & (e_idx < E)[None, :]
                        logits = tl.load(logits_ptr + te, mask=te_ok, other=0.0)
                        ok = tok_ok[:, None] & (kk < TOP_K)[None, :]
                        ent = toks[:, None] * TOP_K + kk[None, :]
                        experts = tl.load(topk_e_ptr + ent, mask=ok, other=0)
                        weights = tl.load(topk_w_ptr + ent, mask=ok, other=0.0)
                        d_w = tl.load(dw_comb + ent, mask=ok, other=0.0)
                        d_logits = routing_backward(logits, experts, weights, d_w, scale, E, E_PAD, TOP_K, K_PAD,
                                                    SIGMOID_GROUP, NORM_TOPK)
                        tl.store(dlogits + te, d_logits, mask=te_ok)
                        # d logits @ Wr, BKE experts a step, read back from where they were just
                        # stored (one block's stores are visible to it after a barrier): holding the
                        # [BT, E] tile in registers across the loop spilled inside it at 256
                        # experts (offline sm_90: 235 spill stores and 374 loads on the dot's line).
                        tl.debug_barrier()
                        part = tl.zeros([BT, BHR], dtype=tl.float32)
                        for i in tl.range(0, N_HR * N_EK, num_stages=RB_STAGES):
                            ek = (i % N_EK) * BKE + tl.arange(0, BKE)
                            cols = (i // N_EK) * BHR + tl.arange(0, BHR)
                            a = tl.load(dlogits + t64[:, None] * E + ek[None, :],
                                        mask=tok_ok[:, None] & (ek < E)[None, :], other=0.0)
                            wr = tl.load(router_w_ptr + ek[:, None] * H + cols[None, :],
                                         mask=(ek < E)[:, None] & (cols < H)[None, :], other=0.0).to(tl.float32)
                            part = router_dot(a, wr, tl.where(i % N_EK == 0, 0.0, part), ROUTER_PRECISION, False,
                                              router_w_ptr.dtype.element_ty.primitive_bitwidth == 16)
                            if i % N_EK == N_EK - 1:
                                tl.store(comb + (t64[:, None] * SLOTS + TOP_K) * H + cols[None, :], part.to(DT),
                                         mask=tok_ok[:, None] & (cols < H)[None, :])
                        tl.debug_barrier()
                        tl.atomic_add(ctl + C_COMB_ARR + toks, 1, mask=tok_ok, sem="release", scope=SCOPE)
                        signal_add(ctl + C_RB_DONE, 1, "gpu")
                        did = 6
                        r = -1
                held_rb = r

        # ---- DH ----
        if MODE == 0:
            if did == 0:
                q = held_dh
                if known:
                    q, open_q = claim(heads + Q_DH, held_dh, n_dh, open_q, OPEN_DH)
                if q >= 0:
                    e, first = locate(cum_dh, el_idx, q)
                    n_rows_e = pick(n_el, el_idx, e)
                    arrived = tl.atomic_add(ctl + C_ARRIVED + w_idx * E_L + e, 0, mask=w_idx < W,
                                            sem="acquire", scope=SCOPE)
                    if tl.sum(tl.where(w_idx < W, arrived, 0), axis=0) == n_rows_e:
                        tl.debug_barrier()
                        if PROXY_FENCE & TILE_TMA:
                            async_proxy_fence()
                        n_tiles_e = pick(tiles_el, el_idx, e)
                        local = q - first
                        ib = local // n_tiles_e
                        m = local % n_tiles_e
                        row0 = pick(row_start_el, el_idx, e) + m * BM
                        n_rows = tl.minimum(n_rows_e - m * BM, BM)
                        rows = row0 + tl.arange(0, BM)
                        row_ok = tl.arange(0, BM) < n_rows
                        w_dn = w_down_ptr + e.to(tl.int64) * H * I
                        wgt = tl.load(recv_w + rows, mask=row_ok, other=0.0)
                        r64 = rows.to(tl.int64)[:, None]
                        fwd = rows
                        if SAVED != SAVED_NONE:
                            # Where the forward kept each row's gate and up projections.
                            src = tl.load(ctl + C_RECV_SRC + rows, mask=row_ok, other=0)
                            ent = tl.load(ctl + C_RECV_ENT + rows, mask=row_ok, other=0)
                            fwd = tl.load(slot_ptr + src.to(tl.int64) * (T_MAX * TOP_K) + ent, mask=row_ok, other=0)
                        kept = saved_ptr + fwd.to(tl.int64) * (2 * I)
                        g_rows = recv_g + row0.to(tl.int64) * H
                        if SAVED == SAVED_ALL:
                            part = kept_swiglu_backward(g_rows, n_rows, w_dn, kept, wgt, r64, row_ok, ib * BN_DH, hw,
                                                        dgu, H, I, BM, BN_DH, BN_EPI, BK, DOT_DTYPE, DX_STAGES,
                                                        TILE_TMA, PROFILE, profile_ptr)
                        else:
                            use_kept = False
                            if SAVED == SAVED_SOME:
                                use_kept = (tl.max(tl.where(row_ok, fwd, 0), axis=0) < save_cap) & (save_cap > 0)
                            if use_kept:
                                part = kept_swiglu_backward(g_rows, n_rows, w_dn, kept, wgt, r64, row_ok, ib * BN_DH,
                                                            hw, dgu, H, I, BM, BN_DH, BN_EPI, BK, DOT_DTYPE, DX_STAGES,
                                                            TILE_TMA, PROFILE, profile_ptr)
                            else:
                                w_e = w_gate_up_ptr + e.to(tl.int64) * 2 * I * H
                                part = recomputed_swiglu_backward(recv_x + rows.to(tl.int64) * H,
                                                                  recv_g + rows.to(tl.int64) * H, n_rows,
                                                                  w_e, w_dn, wgt, r64, row_ok, ib * BN_DH, hw, dgu,
                                                                  H, I, BM, BN_DH, BN_RC, BK, DOT_DTYPE, STAGES)
                        tl.store(dw_part + rows.to(tl.int64) * N_IB + ib, part, mask=row_ok)
                        tl.debug_barrier()
                        tl.atomic_add(ctl + C_DH_DONE + pick(tile_start_el, el_idx, e) + m, 1, sem="release", scope="gpu")
                        tl.atomic_add(ctl + C_DH_EXP + e, 1, sem="release", scope="gpu")
                        did = 4
                        q = -1
                held_dh = q

        # ---- FEED: layout tiles, count exchange, send-list tiles, dispatch chunks ----
        if did == 0:
            a, open_q = claim(heads + Q_FEED, -1, n_feed, open_q, OPEN_FEED)
            if a >= 0:
                if a < n_lt:
                    # Layout tile: per-expert histogram of BT tokens, each choice's rank in it.
                    toks = a * BT + tl.arange(0, BT)
                    tok_ok = toks < n_tokens
                    ok = tok_ok[:, None] & (kk < TOP_K)[None, :]
                    experts = tl.load(topk_e_ptr + toks[:, None] * TOP_K + kk[None, :], mask=ok, other=-1)
                    hits = tl.zeros([BT, E_PAD], dtype=tl.int32)
                    for i in tl.static_range(TOP_K):
                        e_i = tl.sum(tl.where(kk[None, :] == i, experts, 0), axis=1)
                        hits += ((e_idx[None, :] == e_i[:, None]) & tok_ok[:, None]).to(tl.int32)
                    before = tl.cumsum(hits, axis=0) - hits
                    tl.store(ctl + C_HIST + a * E + e_idx, tl.sum(hits, axis=0), mask=e_idx < E)
                    for i in tl.static_range(TOP_K):
                        e_i = tl.sum(tl.where(kk[None, :] == i, experts, 0), axis=1)
                        rank_i = tl.sum(tl.where(e_idx[None, :] == e_i[:, None], before, 0), axis=1)
                        tl.store(ctl + C_TPOS + toks * TOP_K + i, rank_i, mask=tok_ok)
                    signal_add(ctl + C_LAYOUT_A, 1, "gpu")
                    did = 1
                elif a == n_lt:
                    # Count exchange: tile prefix sums in place, then counts to every rank.
                    done = _wait_at_least(ctl + C_LAYOUT_A, n_lt, wait_bound, "gpu")
                    if done < n_lt:
                        record_error(err, abort, ERR_LAYOUT, me, a, me, 0, n_lt, done)
                    else:
                        tl.debug_barrier()
                        # Exclusive prefix over the tiles, PREFIX_ROWS tiles per step: one
                        # dependent round trip per step rather than per tile.
                        running_sum = tl.zeros([E_PAD], dtype=tl.int32)
                        jj = tl.arange(0, PREFIX_ROWS)
                        for j0 in range(0, n_lt, PREFIX_ROWS):
                            hist = ctl + C_HIST + (j0 + jj)[:, None] * E + e_idx[None, :]
                            m_h = ((j0 + jj) < n_lt)[:, None] & (e_idx < E)[None, :]
                            hj = tl.load(hist, mask=m_h, other=0)
                            tl.store(hist, tl.cumsum(hj, axis=0) - hj + running_sum[None, :], mask=m_h)
                            running_sum += tl.sum(hj, axis=0)
                        signal_add(ctl + C_PREFIX, 1, "gpu")
                        for dst in tl.static_range(W):
                            peer_table = peer_ptr(peers_ptr, dst, (C_TABLE + par * W * E + me * E) * 4, tl.int32)
                            tl.store(peer_table + e_idx, running_sum, mask=e_idx < E)
                        tl.debug_barrier()
                        for dst in tl.static_range(W):
                            tl.atomic_xchg(peer_ptr(peers_ptr, dst, (C_FLAG + me) * 4, tl.int32), epoch,
                                           sem="release", scope=SCOPE)
                    did = 2
                elif a < 2 * n_lt + 1:
                    # Send-list tile: each choice at its token-ordered place in its expert's list.
                    b = a - n_lt - 1
                    ready = _wait_at_least(ctl + C_PREFIX, 1, wait_bound, "gpu")
                    if ready < 1:
                        record_error(err, abort, ERR_LAYOUT, me, a, me, 1, 1, ready)
                    else:
                        tl.debug_barrier()
                        toks = b * BT + tl.arange(0, BT)
                        tok_ok = toks < n_tokens
                        ok = tok_ok[:, None] & (kk < TOP_K)[None, :]
                        ent = toks[:, None] * TOP_K + kk[None, :]
                        experts = tl.load(topk_e_ptr + ent, mask=ok, other=0)
                        start = tl.load(ctl + C_HIST + b * E + experts, mask=ok, other=0)
                        rank = tl.load(ctl + C_TPOS + ent, mask=ok, other=0)
                        ok = ok & (experts >= 0)  # a dispatch call may leave choices empty (-1)
                        tl.store(ctl + C_SEND_LIST + experts.to(tl.int64) * T_MAX + start + rank, ent, mask=ok)
                        signal_add(ctl + C_LAYOUT_B, 1, "gpu")
                    did = 1
                elif a < n_feed:
                    # Dispatch chunk: every rank's counts and this rank's send lists first.
                    lists = _wait_at_least(ctl + C_LAYOUT_B, n_lt, wait_bound, "gpu")
                    polls = 0
                    all_in = known
                    while (all_in == 0) & (polls <= wait_bound):
                        _, all_in = count_flags(ctl, epoch, W, W_PAD, C_FLAG, SCOPE)
                        polls += 1
                    if lists < n_lt:
                        record_error(err, abort, ERR_LAYOUT, me, a, me, 2, n_lt, lists)
                    elif all_in == 0:
                        fl, _ = count_flags(ctl, epoch, W, W_PAD, C_FLAG, SCOPE)
                        record_missing_counts(err, abort, me, a, fl, epoch, W, W_PAD)
                    else:
                        tl.debug_barrier()
                        dispatch_chunk(ctl, peers_ptr, me, par, a - 2 * n_lt - 1, x_ptr, g_ptr, topk_w_ptr,
                                       W, W_PAD, E, E_L, EL_PAD, O_PAD, TOP_K, T_MAX, H, BR, BH,
                                       C_TABLE, C_SEND_LIST, C_RECV_SRC, C_RECV_ENT, C_ARRIVED,
                                       B_RECV_X, B_RECV_G, B_RECV_W, True, MODE == 0, SCOPE)
                    did = 3

        # ---- DWGU / DWD: expert weight gradients, each a full reduction over the expert's rows ----
        if MODE == 0:
            if did == 0:
                # One weight-gradient ticket at a time: dW[g;u] tasks first, then dWd.
                q = held_wg
                kind = held_wg_kind
                if known & (q < 0):
                    q, open_q = claim(heads + Q_DWGU, -1, n_dwgu, open_q, OPEN_DWGU)
                    kind = tl.where(q >= 0, 1, 0)
                    if q < 0:
                        q, open_q = claim(heads + Q_DWD, -1, n_dwd, open_q, OPEN_DWD)
                        kind = tl.where(q >= 0, 2, 0)
                if kind > 0:
                    per_e = tl.where(kind == 1, N_WGU_M * N_WGU_S, N_WD_M * N_WD_S)
                    e = q // per_e
                    n_strips = tl.where(kind == 1, N_WGU_S, N_WD_S)
                    mb = (q % per_e) // n_strips
                    sb = (q % per_e) % n_strips
                    n_rows_e = pick(n_el, el_idx, e)
                    need = pick(tiles_el, el_idx, e) * N_IB
                    if tl.atomic_add(ctl + C_DH_EXP + e, 0, sem="acquire", scope="gpu") == need:
                        tl.debug_barrier()
                        if PROXY_FENCE & WG_TMA:
                            async_proxy_fence()
                        r0 = pick(row_start_el, el_idx, e).to(tl.int64)
                        # dW[g;u][j, h] = sum_rows [dg du][row, j] x[row, h] (kind 1) and
                        # dWd[h, i] = sum_rows g[row, h] (w h)[row, i] (kind 2), in one loop.
                        gu = kind == 1
                        a_rows = tl.where(gu, dgu + r0 * (2 * I), recv_g + r0 * H)
                        b_rows = tl.where(gu, recv_x + r0 * H, hw + r0 * I)
                        grad = tl.where(gu, d_gate_up_ptr + e.to(tl.int64) * 2 * I * H, d_down_ptr + e.to(tl.int64) * H * I)
                        m_dim = tl.where(gu, 2 * I, H)
                        n_dim = tl.where(gu, H, I)
                        aligned = (H % 16 == 0) & (I % 16 == 0)
                        row_reduction_strip(a_rows, b_rows, grad, n_rows_e, mb * BWM, sb * WS, m_dim, n_dim,
                                            WS, BWM, BWN, BKW, DOT_DTYPE, WG_STAGES, aligned,
                                            WG_TMA, WG_TMA_STORE, WG_BLOCK_LOOPS, PROFILE,
                                            profile_ptr + PROFILE_WG_EPILOGUE, WG_EVICT_FIRST)
                        did = 8
                        q = -1
                        kind = 0
                held_wg = q
                held_wg_kind = kind

        # ---- DWR: the router weight's gradient over this rank's tokens ----
        if MODE == 0:
            if did == 0:
                q, open_q = claim(heads + Q_DWR, held_wr, n_dwr, open_q, OPEN_DWR)
                if q >= 0:
                    if tl.atomic_add(ctl + C_RB_DONE, 0, sem="acquire", scope="gpu") == n_lt:
                        tl.debug_barrier()
                        mb = q // N_WR_N
                        nb = q % N_WR_N
                        mcols = mb * BRM + tl.arange(0, BRM)
                        ncols = nb * BRN + tl.arange(0, BRN)
                        rr = tl.arange(0, BRK)
                        acc = tl.zeros([BRM, BRN], dtype=tl.float32)
                        for t0 in tl.range(0, n_tokens, BRK, num_stages=1):  # fp32 operands; 2 stages gained nothing
                            toks = (t0 + rr).to(tl.int64)
                            ok = (t0 + rr) < n_tokens
                            at = tl.load(dlogits + toks[:, None] * E + mcols[None, :],
                                         mask=ok[:, None] & (mcols < E)[None, :], other=0.0)
                            b = tl.load(x_ptr + toks[:, None] * H + ncols[None, :],
                                        mask=ok[:, None] & (ncols < H)[None, :], other=0.0).to(tl.float32)
                            acc = router_dot(tl.trans(at), b, acc, ROUTER_PRECISION, False,
                                             x_ptr.dtype.element_ty.primitive_bitwidth == 16)
                        tl.store(d_router_ptr + mcols[:, None] * H + ncols[None, :], acc,
                                 mask=(mcols < E)[:, None] & (ncols < H)[None, :])
                        did = 9
                        q = -1
                held_wr = q

        # ---- Nothing taken: finished, aborted, or waiting. ----
        if did == 0:
            # A pass that ran nothing visited every queue of its mode, so open_q is current.
            finished = ((open_q & OPEN_FEED) == 0) & known
            if MODE == 0:
                finished = (
                    (open_q == 0) & known
                    & (held_dh < 0) & (held_dx < 0) & (held_rb < 0) & (held_wg < 0) & (held_wr < 0) & (held_f < 0)
                )
            else:
                # A dispatch call returns only once every row bound for this rank is here.
                arrived_all = tl.atomic_add(ctl + C_ARRIVED + w_idx[:, None] * E_L + el_idx[None, :], 0,
                                            mask=(w_idx < W)[:, None] & (el_idx < E_L)[None, :],
                                            sem="acquire", scope=SCOPE)
                finished = finished & (tl.sum(tl.sum(arrived_all, axis=1), axis=0) == tl.sum(n_el, axis=0))
            if finished:
                running = 0
            else:
                idle += 1
                if idle > wait_bound:
                    if known == 0:
                        record_missing_counts(err, abort, me, -1, flags, epoch, W, W_PAD)
                    elif held_dh >= 0:
                        g = held_dh
                        e, first = locate(cum_dh, el_idx, g)
                        arrived = tl.atomic_add(ctl + C_ARRIVED + w_idx * E_L + e, 0, mask=w_idx < W,
                                                sem="acquire", scope=SCOPE)
                        record_error(err, abort, ERR_ROWS, me, g, -1, e, pick(n_el, el_idx, e),
                                     tl.sum(tl.where(w_idx < W, arrived, 0), axis=0))
                    elif held_dx >= 0:
                        record_error(err, abort, ERR_DH_TILE, me, held_dx, -1, 0, N_IB, 0)
                    elif held_rb >= 0:
                        r = held_rb
                        toks = r * BT + tl.arange(0, BT)
                        tok_ok = toks < n_tokens
                        got = tl.atomic_add(ctl + C_DW_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
                        bad = tl.min(tl.where((got != TOP_K) & tok_ok, toks, n_tokens), axis=0)
                        record_error(err, abort, ERR_DW, me, r, -1, bad, TOP_K, pick(got, toks, bad))
                    elif held_f >= 0:
                        f = held_f
                        toks = f * BTF + tl.arange(0, BTF)
                        tok_ok = toks < n_tokens
                        got = tl.atomic_add(ctl + C_COMB_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
                        bad = tl.min(tl.where((got != EXPECT_PER_TOKEN) & tok_ok, toks, n_tokens), axis=0)
                        record_error(err, abort, ERR_COMBINE, me, f, -1, bad, EXPECT_PER_TOKEN, pick(got, toks, bad))
                    else:
                        record_error(err, abort, ERR_DH_EXPERT, me, -1, -1, 0, 0, 0)
        else:
            idle = 0
        if PROFILE:
            tl.atomic_add(profile_ptr + did, now() - t_pass, sem="relaxed")
            tl.atomic_add(profile_ptr + 16 + did, 1, sem="relaxed")
        if tl.atomic_add(abort, 0, sem="relaxed") != 0:
            running = 0

    if PROFILE:
        record_worker_span(profile_ptr, t_start)

    # ---- Leave; the last worker out resets the counters for the next call. ----
    tl.debug_barrier()
    if tl.atomic_add(ctl + C_EXIT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        if tl.atomic_add(abort, 0, sem="relaxed") == 0:
            RESET: tl.constexpr = 1024
            # Arrivals, tile and expert counters, and (backward only: a peer's combine call may
            # already be adding to them after a dispatch call) the combine counters.
            RESET_END: tl.constexpr = C_HIST if MODE == 0 else C_COMB_ARR
            for w0 in tl.range(C_ARRIVED, RESET_END, RESET):
                idx = w0 + tl.arange(0, RESET)
                tl.store(ctl + idx, tl.zeros([RESET], tl.int32), mask=idx < RESET_END)
            heads_idx = tl.arange(0, 8)
            tl.store(ctl + C_HEADS + heads_idx, tl.zeros([8], tl.int32))
            tl.store(ctl + C_LAYOUT_A + tl.arange(0, 4), tl.zeros([4], tl.int32))
            tl.store(ctl + C_EXIT, 0)
            tl.debug_barrier()
            tl.store(ctl + C_EPOCH, epoch)
