"""What the persistent kernels share: tickets, task lookup in prefix sums, count tables, dispatch chunks, folds."""

import triton
import triton.language as tl

from .signals import ERR_COUNTS, WORKSPACE_ALIGN, peer_ptr, record_error, row_bases, signal_add


@triton.jit
def pick(vec, idx, i):
    """``vec[i]`` of a vector indexed by ``idx`` (a scalar out of a register vector)."""
    return tl.sum(tl.where(idx == i, vec, 0), axis=0)


@triton.jit
def ticket(head, held, n):
    """This worker's task of a queue of ``n``: the one it holds, else the next unclaimed one, else -1.

    A worker takes a ticket by fetch-and-add whether or not the task is ready, runs it once it
    is, and meanwhile goes on with other queues: claims never collide (a compare-and-swap on
    the head does, once per worker and task, with every worker that read the same head), and
    no worker ever waits on the task it holds. The peek keeps the head from running far past
    ``n`` when every task is taken.
    """
    t = held
    if t < 0:
        if tl.atomic_add(head, 0, sem="relaxed") < n:
            t = tl.atomic_add(head, 1, sem="relaxed")
            t = tl.where(t < n, t, -1)
    return t


@triton.jit
def take_ticket(head, open_q, BIT: tl.constexpr):
    """The next ticket of a queue the worker still visits (bit BIT of ``open_q``), not yet checked
    against the queue's length; -1 for a queue it no longer visits. One fetch-and-add, no peek
    first (one round trip less per claim): a worker whose ticket comes back past the end never
    visits the queue again, so the head ends at most one per worker past the end.

    Apart from ``settle_ticket`` so that a worker can take its next ticket as a tile starts
    and check it once the tile is done: the round trip then overlaps the tile.
    """
    t = -1
    if (open_q & BIT) != 0:
        t = tl.atomic_add(head, 1, sem="relaxed")
    return t


@triton.jit
def settle_ticket(t, n, open_q, BIT: tl.constexpr):
    """A ticket from ``take_ticket`` against the queue's ``n`` tasks: the task (-1: none), and
    ``open_q`` with bit BIT cleared once the queue has no task left to take."""
    if t >= n:
        t = -1
        open_q = open_q & ~BIT
    return t, open_q


@triton.jit
def claim(head, held, n, open_q, BIT: tl.constexpr):
    """``ticket`` for a queue the worker still visits (bit BIT of ``open_q``); returns the task
    (-1: none) and ``open_q``, whose bit is cleared once the queue has no task left to take."""
    t = held
    # take_ticket's fetch-and-add, written out: calling take_ticket here compiled to another
    # register allocation of both persistent kernels (sm_90: forward spills 16 -> 36 B).
    if (held < 0) & ((open_q & BIT) != 0):
        t, open_q = settle_ticket(tl.atomic_add(head, 1, sem="relaxed"), n, open_q, BIT)
    return t, open_q


@triton.jit
def locate(cum, idx, task):
    """For an inclusive prefix sum ``cum``: the bucket holding ``task`` and its first task."""
    bucket = tl.sum((cum <= task).to(tl.int32), axis=0)
    start = tl.sum(tl.where(idx == bucket - 1, cum, 0), axis=0)
    return bucket, start


@triton.jit
def locate_expert(cum, idx, task, n_el, tiles_el, tile_start_el, row_start_el, PER_TILE: tl.constexpr):
    """``locate`` for a prefix sum ``cum`` of ``PER_TILE`` tasks per row tile (``expert_tasks``),
    with the expert's entries of ``expert_rows``: ``(e, first task, rows, row tiles, first row
    tile, first row)``, in two reductions where ``locate`` and four ``pick``s take six.

    Over 256 local experts each reduction crosses the warps (shared memory and a barrier); the
    four entries share one, as a ``[EL_PAD, 2, 2]`` block reduced over the experts.
    """
    e = tl.sum((cum <= task).to(tl.int32), axis=0)
    entries = tl.join(tl.join(n_el, tiles_el), tl.join(tile_start_el, row_start_el))
    at = tl.sum(tl.where((idx == e)[:, None, None], entries, 0), axis=0)
    rows_tiles, starts = tl.split(at)
    n_rows, n_tiles = tl.split(rows_tiles)
    tile_start, row_start = tl.split(starts)
    return e, tile_start * PER_TILE, n_rows, n_tiles, tile_start, row_start


@triton.jit
def recv_table(ctl, par, me, W: tl.constexpr, W_PAD: tl.constexpr, E: tl.constexpr,
                E_L: tl.constexpr, EL_PAD: tl.constexpr, C_TABLE: tl.constexpr):
    """``[W_PAD, EL_PAD]``: rows each source sends to each of this rank's local experts."""
    src = tl.arange(0, W_PAD)[:, None]
    el = tl.arange(0, EL_PAD)[None, :]
    return tl.load(ctl + C_TABLE + par * W * E + src * E + me * E_L + el,
                   mask=(src < W) & (el < E_L), other=0)


@triton.jit
def count_flags(ctl, epoch, W: tl.constexpr, W_PAD: tl.constexpr, C_FLAG: tl.constexpr, SCOPE: tl.constexpr):
    """Every rank's count-exchange flag here (acquire), and whether all show this call's ``epoch``."""
    w_idx = tl.arange(0, W_PAD)
    flags = tl.atomic_add(ctl + C_FLAG + w_idx, 0, mask=w_idx < W, sem="acquire", scope=SCOPE)
    return flags, tl.sum(((flags >= epoch) & (w_idx < W)).to(tl.int32), axis=0) == W


@triton.jit
def record_missing_counts(err, abort, me, task, flags, epoch, W: tl.constexpr, W_PAD: tl.constexpr):
    """Record a timeout on the first rank whose ``flags`` entry does not show this call's counts."""
    w_idx = tl.arange(0, W_PAD)
    missing = tl.min(tl.where((flags < epoch) & (w_idx < W), w_idx, W_PAD), axis=0)
    record_error(err, abort, ERR_COUNTS, me, task, missing, 0, epoch, pick(flags, w_idx, missing))


@triton.jit
def poll_counts(ctl, epoch, par, me, W: tl.constexpr, W_PAD: tl.constexpr, E: tl.constexpr,
                E_L: tl.constexpr, EL_PAD: tl.constexpr, C_FLAG: tl.constexpr, C_TABLE: tl.constexpr,
                SCOPE: tl.constexpr):
    """One look at the count exchange: ``(known, flags, table)``, the receive table zeros until
    every rank's counts of this call are in.

    A worker looks until they are, then keeps what it read (peers write the next call's counts
    into the other parity).
    """
    flags, known = count_flags(ctl, epoch, W, W_PAD, C_FLAG, SCOPE)
    tl.debug_barrier()
    table = tl.where(known, recv_table(ctl, par, me, W, W_PAD, E, E_L, EL_PAD, C_TABLE), 0)
    return known, flags, table


@triton.jit
def expert_rows(table, BM: tl.constexpr):
    """From the receive table: rows per local expert, their row tiles, and each expert's first tile and row."""
    n_el = tl.sum(table, axis=0)
    tiles_el = tl.cdiv(n_el, BM)
    return n_el, tiles_el, tl.cumsum(tiles_el, axis=0) - tiles_el, tl.cumsum(n_el, axis=0) - n_el


@triton.jit
def expert_tasks(table, BM: tl.constexpr, N_A: tl.constexpr, N_B: tl.constexpr):
    """``expert_rows``, then for two task kinds with N_A and N_B tasks per row tile: the
    inclusive prefix sums of their tasks over local experts (for ``locate``) and their totals.

    The kernels compute this once, when the counts come in, and carry it: recomputed every
    pass, its prefix sums (shared-memory scans and barriers) cost each task a few microseconds.
    """
    n_el, tiles_el, tile_start_el, row_start_el = expert_rows(table, BM)
    return (n_el, tiles_el, tile_start_el, row_start_el,
            tl.cumsum(tiles_el * N_A, axis=0), tl.cumsum(tiles_el * N_B, axis=0),
            tl.sum(tiles_el * N_A, axis=0), tl.sum(tiles_el * N_B, axis=0))


@triton.jit
def dispatch_chunk(
    ctl, peers_ptr, me, par, d, x_ptr, g_ptr, weights_ptr,
    W: tl.constexpr, W_PAD: tl.constexpr, E: tl.constexpr, E_L: tl.constexpr, EL_PAD: tl.constexpr,
    O_PAD: tl.constexpr, TOP_K: tl.constexpr, T_MAX: tl.constexpr, H: tl.constexpr,
    BR: tl.constexpr, BH: tl.constexpr,
    C_TABLE: tl.constexpr, C_SEND_LIST: tl.constexpr, C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr,
    C_ARRIVED: tl.constexpr, B_RECV_X: tl.constexpr, B_RECV_G: tl.constexpr, B_RECV_W: tl.constexpr,
    COPY_LOCAL: tl.constexpr, WITH_G: tl.constexpr, SCOPE: tl.constexpr,
):
    """Dispatch chunk ``d`` of this rank: up to BR rows bound for one (destination, local expert).

    Chunks run in (local expert, destination) order, the order in which receivers consume
    them. Each row lands in the destination's expert-major slot (expert, then source rank,
    then send-list position), with its source, entry and routing weight; then the
    destination's arrival counter of (this source, that expert) is raised. Rows of ``x`` (and
    of ``g`` with WITH_G) are copied, except to this rank itself unless COPY_LOCAL: local rows
    are read in place by the expert tiles. Needs every rank's counts (count table ``par``).

    Each copy step loads, then stores, and the compiler cannot move the next load above a store
    that may alias it. Issuing each step's loads (``x`` and ``g`` together) before the previous
    step's stores did not shorten the backward's dispatch (stop 53, H100 80GB, DeepSeek-V3 32
    experts: 0.53 against 0.58 ms busy per worker, steps as long; slower at 256 experts). The
    copy writes 940 MB there (x and g rows, 32,768 of each): about 1.7 TB/s if every worker
    copies at once, as at the start, so it likely waits on DRAM writes, not on load latency.
    """
    DT = x_ptr.dtype.element_ty
    o_idx = tl.arange(0, O_PAD)
    w_idx = tl.arange(0, W_PAD)
    el_idx = tl.arange(0, EL_PAD)
    n_o = tl.load(ctl + C_TABLE + par * W * E + me * E + (o_idx % W) * E_L + o_idx // W, mask=o_idx < E, other=0)
    cum = tl.cumsum(tl.cdiv(n_o, BR), axis=0)
    if d < tl.sum(tl.cdiv(n_o, BR), axis=0):
        o, first = locate(cum, o_idx, d)
        el = o // W
        dst = o % W
        n_rows_o = pick(n_o, o_idx, o)
        pos = (d - first) * BR + tl.arange(0, BR)
        row_ok = pos < n_rows_o
        ent = tl.load(ctl + C_SEND_LIST + (dst * E_L + el).to(tl.int64) * T_MAX + pos, mask=row_ok, other=0)
        tok = (ent // TOP_K).to(tl.int64)
        src2 = w_idx[:, None]
        el2 = el_idx[None, :]
        dst_tab = tl.load(ctl + C_TABLE + par * W * E + src2 * E + dst * E_L + el2,
                          mask=(src2 < W) & (el2 < E_L), other=0)
        expert_base = tl.sum(tl.sum(tl.where(el2 < el, dst_tab, 0), axis=1), axis=0)
        src_off = tl.sum(tl.sum(tl.where((el2 == el) & (src2 < me), dst_tab, 0), axis=1), axis=0)
        slot = (expert_base + src_off + pos).to(tl.int64)
        if (dst != me) | COPY_LOCAL:
            dst_x = peer_ptr(peers_ptr, dst, B_RECV_X, DT)
            dst_g = peer_ptr(peers_ptr, dst, B_RECV_G, DT)
            for h0 in tl.range(0, H, BH):
                cols = h0 + tl.arange(0, BH)
                m2 = row_ok[:, None] & (cols < H)[None, :]
                v = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=m2)
                tl.store(dst_x + slot[:, None] * H + cols[None, :], v, mask=m2)
                if WITH_G:
                    v = tl.load(g_ptr + tok[:, None] * H + cols[None, :], mask=m2)
                    tl.store(dst_g + slot[:, None] * H + cols[None, :], v, mask=m2)
        dst_ctl = peer_ptr(peers_ptr, dst, 0, tl.int32)
        tl.store(dst_ctl + C_RECV_SRC + slot, tl.zeros_like(ent) + me, mask=row_ok)
        tl.store(dst_ctl + C_RECV_ENT + slot, ent, mask=row_ok)
        tl.store(peer_ptr(peers_ptr, dst, B_RECV_W, tl.float32) + slot,
                 tl.load(weights_ptr + ent, mask=row_ok, other=0.0), mask=row_ok)
        signal_add(dst_ctl + C_ARRIVED + me * E_L + el, tl.sum(row_ok.to(tl.int32), axis=0), SCOPE)


@triton.jit
def combine_destination(peers_ptr, src, ent, DT: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                        H: tl.constexpr, B_COMB: tl.constexpr, W: tl.constexpr):
    """Where the results of received rows go: per row, a pointer to its (token, choice) row of
    its source rank's combine buffer; and, for the arrival signal, the source's workspace base
    (int64) and the token. ``src`` and ``ent`` are the rows' source ranks (below ``W``) and entries."""
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    tok = ent // TOP_K
    slot = (tok * SLOTS + ent % TOP_K).to(tl.int64)
    base = row_bases(peers_ptr, src, W)
    return tl.multiple_of(base.to(tl.pointer_type(DT)), WORKSPACE_ALIGN) + B_COMB // ES + slot * H, base, tok


@triton.jit
def fold_block(comb, out_ptr, toks, tok_ok, valid, H: tl.constexpr, SLOTS: tl.constexpr, N_SUM: tl.constexpr,
               BTF: tl.constexpr, BHF: tl.constexpr, K_PAD: tl.constexpr, MASKED: tl.constexpr):
    """``out[t] = sum_s comb[t, s]`` over the first ``N_SUM`` of each token's ``SLOTS`` rows, in fp32.

    With MASKED only the slots where ``valid[t, s]`` (``[BTF, K_PAD]``) count: a choice left
    empty never wrote its row. Slots are added in a fixed order, so the fold is deterministic.
    """
    t64 = toks.to(tl.int64)
    kk = tl.arange(0, K_PAD)
    for h0 in tl.range(0, H, BHF):
        cols = h0 + tl.arange(0, BHF)
        m2 = tok_ok[:, None] & (cols < H)[None, :]
        acc = tl.zeros([BTF, BHF], dtype=tl.float32)
        for s in tl.static_range(N_SUM):
            m_s = m2
            if MASKED:
                m_s = m2 & (tl.sum(tl.where(kk[None, :] == s, valid.to(tl.int32), 0), axis=1) > 0)[:, None]
            acc += tl.load(comb + (t64[:, None] * SLOTS + s) * H + cols[None, :], mask=m_s, other=0.0).to(tl.float32)
        tl.store(out_ptr + t64[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)
