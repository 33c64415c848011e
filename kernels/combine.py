"""The standalone combine: expert outputs back to their source ranks, folded per token.

It runs on the workspace of the dispatch call it answers (``expert_backward_kernel`` with
``MODE=1``: the same layout, count tables and row metadata), so the handle is the workspace.

Task queues (priority order)
----------------------------
FOLD  one per block of BTF local tokens: ``out[t] = sum_k comb[t, k]`` over the token's valid
      choices (``topk_idx >= 0``). Ready when each of them has arrived.
SEND  one per BM received rows, in slot order: each row times its routing weight (when
      WEIGHTED) goes straight into its source rank's combine buffer, then the source's
      per-token counter is raised. Always ready.

FOLD is taken by ticket (a worker holds its fold and sends rows until it is ready), SEND by
fetch-and-add. FOLD waits only on SEND tasks, which wait on nothing, so with any number of
workers the earliest unfinished task is running, held or claimable. Counters are reset by
the last worker of this rank, after its fold has seen every peer's write of this call.
"""

import triton
import triton.language as tl

from .queues import combine_destination, fold_block, ticket
from .signals import ERR_COMBINE, ERR_SHORT, peer_ptr, record_error

Q_SEND = tl.constexpr(0)
Q_FOLD = tl.constexpr(1)
C_EPOCH = tl.constexpr(0)
C_EXIT = tl.constexpr(1)
C_ABORT = tl.constexpr(2)
C_HEADS = tl.constexpr(8)
C_ERR = tl.constexpr(16)


@triton.jit(do_not_specialize=["y_rows", "n_tokens", "me", "wait_bound"])
def combine_kernel(
    y_ptr, y_rows, out_ptr, topk_e_ptr, n_tokens, peers_ptr, me, wait_bound,
    H: tl.constexpr, E: tl.constexpr, E_L: tl.constexpr, TOP_K: tl.constexpr, W: tl.constexpr,
    T_MAX: tl.constexpr,
    C_TABLE: tl.constexpr, C_COMB_ARR: tl.constexpr, C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr,
    B_RECV_W: tl.constexpr, B_COMB: tl.constexpr,
    BM: tl.constexpr, BH: tl.constexpr, BTF: tl.constexpr, BHF: tl.constexpr,
    W_PAD: tl.constexpr, EL_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SCOPE: tl.constexpr, WEIGHTED: tl.constexpr,
):
    DT = y_ptr.dtype.element_ty
    SLOTS: tl.constexpr = TOP_K   # the exchange's combine buffer (backward_layout, rows_only)
    ctl = peer_ptr(peers_ptr, me, 0, tl.int32)
    heads = ctl + C_HEADS
    err = ctl + C_ERR
    abort = ctl + C_ABORT
    recv_w = peer_ptr(peers_ptr, me, B_RECV_W, tl.float32)
    comb = peer_ptr(peers_ptr, me, B_COMB, DT)

    # The count table of the dispatch call this answers (its epoch is the one stored last).
    par = tl.load(ctl + C_EPOCH) % 2
    src = tl.arange(0, W_PAD)[:, None]
    el = tl.arange(0, EL_PAD)[None, :]
    table = tl.load(ctl + C_TABLE + par * W * E + src * E + me * E_L + el, mask=(src < W) & (el < E_L), other=0)
    n_rows = tl.sum(tl.sum(table, axis=1), axis=0)
    n_send = tl.cdiv(n_rows, BM)
    n_fold = tl.cdiv(n_tokens, BTF)
    kk = tl.arange(0, K_PAD)

    running = 1
    if n_rows > y_rows:  # fewer expert outputs than dispatched rows: refuse rather than read past y
        record_error(err, abort, ERR_SHORT, me, 0, -1, 0, n_rows, y_rows)
        running = 0
    idle = 0
    held_f = -1  # this worker's fold ticket (see kernels.expert_forward, "Claiming: tickets")
    while running > 0:
        did = 0
        f = ticket(heads + Q_FOLD, held_f, n_fold)
        if f >= 0:
            toks = f * BTF + tl.arange(0, BTF)
            tok_ok = toks < n_tokens
            valid = tl.load(topk_e_ptr + toks[:, None] * TOP_K + kk[None, :],
                            mask=tok_ok[:, None] & (kk < TOP_K)[None, :], other=-1) >= 0
            expect = tl.sum(valid.to(tl.int32), axis=1)
            got = tl.atomic_add(ctl + C_COMB_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
            if tl.sum(((got != expect) & tok_ok).to(tl.int32), axis=0) == 0:
                tl.debug_barrier()
                fold_block(comb, out_ptr, toks, tok_ok, valid, H, SLOTS, TOP_K, BTF, BHF, K_PAD, True)
                did = 2
                f = -1
        held_f = f
        if did == 0:
            if tl.atomic_add(heads + Q_SEND, 0, sem="relaxed") < n_send:
                q = tl.atomic_add(heads + Q_SEND, 1, sem="relaxed")
                if q < n_send:
                    rows = q * BM + tl.arange(0, BM)
                    row_ok = rows < n_rows
                    src_r = tl.load(ctl + C_RECV_SRC + rows, mask=row_ok, other=0)
                    ent = tl.load(ctl + C_RECV_ENT + rows, mask=row_ok, other=0)
                    dst_rows, base, tok = combine_destination(peers_ptr, src_r, ent, DT, TOP_K, SLOTS, H, B_COMB, W)
                    wgt = tl.load(recv_w + rows, mask=row_ok, other=0.0)
                    for h0 in tl.range(0, H, BH):
                        cols = h0 + tl.arange(0, BH)
                        m2 = row_ok[:, None] & (cols < H)[None, :]
                        v = tl.load(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m2, other=0.0)
                        if WEIGHTED:
                            v = (v.to(tl.float32) * wgt[:, None]).to(DT)
                        tl.store(dst_rows[:, None] + cols[None, :], v, mask=m2)
                    tl.debug_barrier()
                    arrive = (base + (C_COMB_ARR + tok).to(tl.int64) * 4).to(tl.pointer_type(tl.int32))
                    tl.atomic_add(arrive, 1, mask=row_ok, sem="release", scope=SCOPE)
                did = 1
        if did == 0:
            if (tl.atomic_add(heads + Q_SEND, 0, sem="relaxed") >= n_send) & (
                tl.atomic_add(heads + Q_FOLD, 0, sem="relaxed") >= n_fold
            ) & (held_f < 0):
                running = 0
            else:
                idle += 1
                if idle > wait_bound:
                    f = tl.where(held_f >= 0, held_f, tl.atomic_add(heads + Q_FOLD, 0, sem="relaxed"))
                    toks = f * BTF + tl.arange(0, BTF)
                    tok_ok = toks < n_tokens
                    valid = tl.load(topk_e_ptr + toks[:, None] * TOP_K + kk[None, :],
                                    mask=tok_ok[:, None] & (kk < TOP_K)[None, :], other=-1) >= 0
                    expect = tl.sum(valid.to(tl.int32), axis=1)
                    got = tl.atomic_add(ctl + C_COMB_ARR + toks, 0, mask=tok_ok, sem="acquire", scope=SCOPE)
                    bad = tl.min(tl.where((got != expect) & tok_ok, toks, n_tokens), axis=0)
                    record_error(err, abort, ERR_COMBINE, me, f, -1, bad,
                                 tl.sum(tl.where(toks == bad, expect, 0), axis=0),
                                 tl.sum(tl.where(toks == bad, got, 0), axis=0))
        else:
            idle = 0
        if tl.atomic_add(abort, 0, sem="relaxed") != 0:
            running = 0

    tl.debug_barrier()
    if tl.atomic_add(ctl + C_EXIT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        if tl.atomic_add(abort, 0, sem="relaxed") == 0:
            RESET: tl.constexpr = 1024
            for w0 in tl.range(C_COMB_ARR, C_COMB_ARR + T_MAX, RESET):
                idx = w0 + tl.arange(0, RESET)
                tl.store(ctl + idx, tl.zeros([RESET], tl.int32), mask=idx < C_COMB_ARR + T_MAX)
            tl.store(heads + tl.arange(0, 8), tl.zeros([8], tl.int32))
            tl.store(ctl + C_EXIT, 0)
