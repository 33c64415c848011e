"""The persistent forward kernel of the expert layer: router to fold in one launch per rank.

Workers
-------
Every program of the grid is a worker of its rank. A worker loops: it looks at the heads of
the task queues below in priority order, takes the first task that is ready, runs it, and
starts over. Nobody assigns roles: a worker computes when a compute task is ready and moves
data when none is, so the split between communication and computation follows the data.

Task queues (priority order: the consumer closest to the output first)
----------------------------------------------------------------------
FOLD      one per block of BTF local tokens: ``out[t] = sum_k comb[t, k]`` (the weights were
          applied in the down epilogue; the shared expert's result is slot ``top_k``).
          Ready when every routed and shared result row of the block has arrived.
DOWN      routed ``y = h @ Wd^T`` for (local expert, H-block, row tile), row tile fastest so
          that the workers running at once share one weight block. The epilogue scales by the
          routing weight and stores each row straight into its source rank's combine buffer
          (the combine is fused into the GEMM), then signals the source. Ready when all
          gate/up tiles of the row tile are done.
SDOWN     the shared expert's down projection, same shape, into the local combine buffer.
GATE_UP   routed ``h = silu(x Wg^T) * (x Wu^T)`` for (local expert, I-block, row tile).
          Ready when every source rank has delivered its rows of that expert. Rows from this
          rank are not copied: dispatch sends only their metadata and the tile reads them
          from the input in place. A training call also keeps the gate and up projections
          for the backward (``routed_gate_up_rows``), which then needs no GEMM to redo them.
FEED      route tiles, then the count exchange, then dispatch chunks (what everything else
          waits for); route tiles and the count exchange run when taken, a dispatch chunk
          once every rank's counts are in:
            route tile k      router GEMM + top-k for BT tokens; appends each (token, k) to the
                              send list of its expert and counts it. A training call keeps
                              the fp32 logits (``logits_ptr``) for the backward's RBWD.
            count exchange    after all route tiles: writes this rank's per-expert counts into
                              every peer's table and sets its flag there to the call's epoch.
            dispatch chunk    after every peer's counts are in: copies up to BR rows bound for
                              one (destination, expert) into the destination's expert-major
                              receive buffer, then adds the row count to the destination's
                              arrival counter of (this source, that expert). Chunks are ordered
                              by local expert index, the order in which receivers consume them.
SGATE_UP  the shared expert's gate/up tiles: always ready, so they fill idle time, last. A
          training call also keeps their projections (``s_saved_ptr``, ``2 I_s`` wide) for
          the shared experts' backward, which then redoes none of their forward GEMMs.

Operands
--------
With ``TMA`` (Hopper and later, 16-byte row strides) the weight blocks of the GEMM tiles come
through tensor descriptors: the copy engine fills shared memory without the workers' address
arithmetic (H200, DeepSeek-V3 one-rank view: in-kernel GEMM 528 -> 608 TFLOP/s). Rows
(received, local or activations) stay plain loads: they are written in this launch, and plain
loads need no fence between the writers' generic proxy and the copy engine's.

Claiming: tickets
-----------------
FOLD, DOWN, SDOWN, GATE_UP and FEED are claimed by ticket (``queues.claim``): a worker takes
the next task of the queue by fetch-and-add whether or not it is ready, keeps it, and runs it
in the first pass that finds it ready; in the passes between it goes on down the queue list and
runs whatever else is ready. A worker holds at most one waiting ticket per queue, so tickets
are taken in queue order, about one per worker ahead of the work. A worker that starts a DOWN
task takes its next ticket of that queue at once (claiming it in a pass instead timed the same
on an H200, stop 51), so the claim's round trip overlaps the tile instead of preceding the next
one; while that tile runs it waits on nothing, so the held ticket is again the only one of that
queue it will wait on. GATE_UP tickets are claimed only in the pass that reaches that queue: a
GATE_UP ticket taken ahead would wait behind every DOWN tile its worker finds ready, and
consecutive tickets, the row tiles that share a weight block, would start far apart in time and
read the block from DRAM again (``GU_CLAIM_AHEAD``, ``Tiles.gate_up_claim_ahead``, claims ahead
as DOWN does; 4-9% slower on an H100). A dispatch chunk taken before the counts are in is held
the same way (the workers that finished routing used to spin in it for the whole route phase;
now they run shared-expert tiles meanwhile). SGATE_UP is claimed by fetch-and-add and is ready
by construction.
Claims by compare-and-swap on a shared head collide: every worker that read the same head
value retries. With such claims, passes that ran nothing took 6.4 of the 14.6 ms of the
DeepSeek-V3 one-rank forward on the H200 (132 workers; benchmarks/layer_forward.py's
profile); with tickets 0.2 ms, and the call 8.2 ms.

Why it cannot deadlock (DESIGN.md invariant 2)
----------------------------------------------
No worker ever waits on a ticket it holds: each pass it checks it and otherwise runs other
work, so a held task waits only on its dependencies, never on its holder. The only task that
spins in place is the count exchange, and it waits only on this rank's route tiles, which
precede it in the FEED queue and so are already claimed by running workers that wait on
nothing. A dispatch chunk waits on every rank's count exchange. Readiness follows the order
FEED < GATE_UP < DOWN < FOLD across all ranks, a single topological order. Whatever is earliest unfinished in that order
has its dependencies done, so it is running, held by a worker that will run it at its next
pass, or unclaimed and claimable by the next worker with a free slot for that queue (one whose
ticket there has run). FOLD and SDOWN are claimed only by a worker that has found DOWN,
respectively SGATE_UP, taken to its end; when one of them is earliest unfinished, every task of
that queue has run, so the next worker that visits it finds it so, and claims next pass. So
the protocol finishes with any number of workers per rank, one included, provided every
rank's kernel is running (the fabric guarantees residency).

Epochs and buffer reuse
-----------------------
Count-exchange flags hold the epoch of the sender's latest call (1, 2, ...), so they never
need resetting. A peer may run one call ahead (never two: its next dispatch needs this rank's
next counts), so a flag at or above this call's epoch means the counts are in, and the count
table is double-buffered by epoch parity. All other counters are reset by the
last worker to leave, which is safe because every write a peer makes to them in a call is
awaited by this rank in the same call. The epoch is then advanced in memory, so consecutive
launches (or CUDA graph replays) need no host work.

Waits are bounded by ``wait_bound`` polls. A worker that exceeds it writes an error record
(kind, rank, task, peer, index, expected, observed), raises the abort flag and leaves; the
host turns the record into an exception.
"""

import triton
import triton.language as tl

from .profile import now, record_worker_span
from .queues import (
    claim as _claim, combine_destination, dispatch_chunk, expert_tasks, fold_block, locate as _locate,
    locate_expert, pick as _pick,
    poll_counts, record_missing_counts, settle_ticket, take_ticket,
)
from .route import router_logits, top_k_routing
from .signals import (
    ERR_COMBINE, ERR_GATE_UP, ERR_ROUTE, ERR_ROWS, ERR_SHARED,
    peer_ptr, record_error, signal_add,
)
from .tile_gemm import (
    down_tile, down_tile_tma_w, gate_up_acc, gate_up_acc_tma, gate_up_pair_acc, gate_up_pair_acc_tma, store_gate_up,
    store_swiglu,
)

# With PROFILE, every pass of a worker adds its nanoseconds to int64 slot ``kind`` of
# ``profile_ptr`` and one to slot ``16 + kind``. Slot 0 is passes that found nothing ready.
PROFILE_SLOTS = ("idle", "route", "count_exchange", "dispatch", "gate_up", "down",
                 "shared_gate_up", "shared_down", "fold", "gate_up_epilogue", "down_epilogue",
                 "idle_gate_up_held", "idle_down_held", "idle_fold_or_shared_held", "idle_nothing_held",
                 "idle_gate_up_held_after_first")
# Parts of the routed GEMM tasks' time above (not passes of their own): from a tile's last
# dot to the end of its stores (a down tile's: and of its arrival signals to the source ranks).
PROFILE_GATE_UP_EPILOGUE = tl.constexpr(PROFILE_SLOTS.index("gate_up_epilogue"))
PROFILE_DOWN_EPILOGUE = tl.constexpr(PROFILE_SLOTS.index("down_epilogue"))
# Parts of "idle" by what the worker held, the most upstream first: a GATE_UP ticket whose rows
# have not all arrived, else a DOWN ticket whose gate/up tiles are not all done, else a FOLD or
# SDOWN ticket; "nothing" also holds the wait for every rank's counts.
PROFILE_IDLE_GATE_UP = tl.constexpr(PROFILE_SLOTS.index("idle_gate_up_held"))
PROFILE_IDLE_DOWN = tl.constexpr(PROFILE_SLOTS.index("idle_down_held"))
PROFILE_IDLE_TAIL = tl.constexpr(PROFILE_SLOTS.index("idle_fold_or_shared_held"))
PROFILE_IDLE_NOTHING = tl.constexpr(PROFILE_SLOTS.index("idle_nothing_held"))
# The part of "idle_gate_up_held" after the worker's first gate/up tile: at EP=1 only the
# route phase should leave a GATE_UP ticket waiting, so what lands here is a wait on dispatch
# chunks later on (stops 40 and 45 saw 1.7-3.8 ms of "idle_gate_up_held" per worker with 4
# gate/up stages at DeepSeek-V3 256 experts).
PROFILE_IDLE_GATE_UP_LATE = tl.constexpr(PROFILE_SLOTS.index("idle_gate_up_held_after_first"))

# Queue slots in the control block.
Q_FEED = tl.constexpr(0)
Q_GATE_UP = tl.constexpr(1)
Q_DOWN = tl.constexpr(2)
Q_SGATE_UP = tl.constexpr(3)
Q_SDOWN = tl.constexpr(4)
Q_FOLD = tl.constexpr(5)
# Bit ``1 << q`` of a worker's ``open_q`` stands for queue ``q``.
OPEN_FEED, OPEN_GATE_UP, OPEN_DOWN, OPEN_SGATE_UP, OPEN_SDOWN, OPEN_FOLD = (
    tl.constexpr(1 << q.value) for q in (Q_FEED, Q_GATE_UP, Q_DOWN, Q_SGATE_UP, Q_SDOWN, Q_FOLD))
ALL_OPEN = tl.constexpr(OPEN_FEED | OPEN_GATE_UP | OPEN_DOWN | OPEN_SGATE_UP | OPEN_SDOWN | OPEN_FOLD)

# Fixed control words (int32 indices into a rank's workspace).
C_EPOCH = tl.constexpr(0)
C_EXIT = tl.constexpr(1)
C_ABORT = tl.constexpr(2)
C_ROUTE_DONE = tl.constexpr(3)
C_HEADS = tl.constexpr(8)
C_ERR = tl.constexpr(16)
C_FIXED = tl.constexpr(32)


@triton.jit
def routed_gate_up_rows(
    x_ptr, recv_x, ctl, me, row0, n_rows, e, ib, w_gate_up_ptr, w_gate_up_desc, h_r, saved_ptr, slot_ptr, save_cap,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, T_MAX: tl.constexpr,
    C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr,
    ROWS: tl.constexpr, BN_GU: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, ROWS_ALIGNED: tl.constexpr, ONE_DOT: tl.constexpr, PROFILE: tl.constexpr, profile_ptr,
):
    """A routed gate/up tile: ``n_rows <= ROWS`` received rows from ``row0`` of local expert ``e``,
    column block ``ib``, into ``h``. Rows from this rank were never copied: they are read in place.

    For a training call (``save_cap > 0``) the tile also keeps the gate and up projections of
    received rows below ``save_cap`` for the backward (``saved_ptr``, ``2 I`` wide), and the
    column-block-0 tile records each row's place under its (source, token, choice) in
    ``slot_ptr``: the backward lays its rows out in its own order and finds them there.
    """
    rows = row0 + tl.arange(0, ROWS)
    row_ok = tl.arange(0, ROWS) < n_rows
    src = tl.load(ctl + C_RECV_SRC + rows, mask=row_ok, other=0)
    ent = tl.load(ctl + C_RECV_ENT + rows, mask=row_ok, other=0)
    a_rows = tl.where(src == me, x_ptr + (ent // TOP_K).to(tl.int64) * H, recv_x + rows.to(tl.int64) * H)
    if ROWS_ALIGNED:
        # The launcher checked that every row of both sources starts 16-byte aligned. The
        # select between two pointers loses the alignment the compiler knew of each; without
        # it the row loads are plain loads, not pipelined asynchronous copies, and every wgmma
        # of the tile waits for them (benchmarks/kernel_resources.py reports the loop).
        a_rows = tl.multiple_of(a_rows, 16)
    w_e = w_gate_up_ptr + e.to(tl.int64) * 2 * I * H
    if ONE_DOT:  # gate and up blocks side by side in one dot (Tiles.gate_up_one_dot)
        if TMA:
            acc_g, acc_u = gate_up_pair_acc_tma(a_rows, n_rows, w_gate_up_desc, 2 * e, ib * BN_GU, H, ROWS, BN_GU, BK,
                                                DOT_DTYPE, STAGES)
        else:
            acc_g, acc_u = gate_up_pair_acc(a_rows, n_rows, w_e, ib * BN_GU, H, I, ROWS, BN_GU, BK, DOT_DTYPE, STAGES)
    elif TMA:
        acc_g, acc_u = gate_up_acc_tma(a_rows, n_rows, w_gate_up_desc, e * 2 * I, w_gate_up_desc, e * 2 * I + I,
                                       ib * BN_GU, H, ROWS, BN_GU, BK, DOT_DTYPE, STAGES)
    else:
        acc_g, acc_u = gate_up_acc(a_rows, n_rows, w_e, w_e + I * H, ib * BN_GU, H, I, ROWS, BN_GU, BK,
                                   DOT_DTYPE, STAGES)
    t_epilogue = now() if PROFILE else 0
    cols = ib * BN_GU + tl.arange(0, BN_GU)
    store_swiglu(acc_g, acc_u, h_r + row0.to(tl.int64) * I, tl.arange(0, ROWS), cols, row_ok, I)
    if save_cap > 0:
        store_gate_up(acc_g, acc_u, saved_ptr, rows, cols, row_ok & (rows < save_cap), I)
        if ib == 0:
            tl.store(slot_ptr + src.to(tl.int64) * (T_MAX * TOP_K) + ent, rows, mask=row_ok)
    if PROFILE:
        tl.atomic_add(profile_ptr + PROFILE_GATE_UP_EPILOGUE, now() - t_epilogue, sem="relaxed")


@triton.jit
def routed_down_rows(
    h_r, row0, n_rows, e, hb, w_down_ptr, w_down_desc, recv_w, ctl, peers_ptr, me,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, T_MAX: tl.constexpr, W: tl.constexpr,
    C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr, C_COMB_ARR: tl.constexpr, B_COMB: tl.constexpr,
    ROWS: tl.constexpr, BN_DN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, SCOPE: tl.constexpr, PROFILE: tl.constexpr, profile_ptr,
):
    """A routed down tile: ``n_rows <= ROWS`` rows of ``h`` from ``row0`` (local expert ``e``),
    column block ``hb``; each row scaled by its routing weight and stored straight into its source
    rank's combine buffer (the combine is fused into the GEMM), then the source is signalled."""
    DT = h_r.dtype.element_ty
    if TMA:
        acc = down_tile_tma_w(h_r + row0.to(tl.int64) * I, n_rows, w_down_desc, e * H, hb * BN_DN,
                              I, ROWS, BN_DN, BK, DOT_DTYPE, STAGES)
    else:
        acc = down_tile(h_r + row0.to(tl.int64) * I, n_rows, w_down_ptr + e.to(tl.int64) * H * I, hb * BN_DN,
                        I, H, ROWS, BN_DN, BK, DOT_DTYPE, STAGES)
    t_epilogue = now() if PROFILE else 0
    rows = row0 + tl.arange(0, ROWS)
    row_ok = tl.arange(0, ROWS) < n_rows
    wgt = tl.load(recv_w + rows, mask=row_ok, other=0.0)
    src = tl.load(ctl + C_RECV_SRC + rows, mask=row_ok, other=0)
    ent = tl.load(ctl + C_RECV_ENT + rows, mask=row_ok, other=0)
    dst_rows, base, tok = combine_destination(peers_ptr, src, ent, DT, TOP_K, SLOTS, H, B_COMB, W)
    cols = hb * BN_DN + tl.arange(0, BN_DN)
    tl.store(dst_rows[:, None] + cols[None, :], (acc * wgt[:, None]).to(DT), mask=row_ok[:, None] & (cols < H)[None, :])
    tl.debug_barrier()
    arrive = (base + (C_COMB_ARR + me * T_MAX + tok).to(tl.int64) * 4).to(tl.pointer_type(tl.int32))
    tl.atomic_add(arrive, 1, mask=row_ok, sem="release", scope=SCOPE)
    if PROFILE:
        tl.atomic_add(profile_ptr + PROFILE_DOWN_EPILOGUE, now() - t_epilogue, sem="relaxed")


# Token count, rank, wait bound, saved rows and the shared-projection switch are not
# specialised, so every rank of a world and every call, training or not, runs one compiled
# kernel: loading a new module while a peer's persistent kernel spins may wait for that kernel
# (CUDA lazy loading serialises module loads with running work).
@triton.jit(do_not_specialize=["n_tokens", "me", "wait_bound", "save_cap", "save_shared", "save_logits"])
def expert_forward_kernel(
    x_ptr, out_ptr, n_tokens, saved_ptr, slot_ptr, save_cap, s_saved_ptr, save_shared, logits_ptr, save_logits,
    router_w_ptr, bias_ptr, scale,
    w_gate_up_ptr, w_down_ptr, s_gate_ptr, s_up_ptr, s_down_ptr,
    w_gate_up_desc, w_down_desc, s_gate_desc, s_up_desc, s_down_desc,
    peers_ptr, me, wait_bound, profile_ptr,
    # Shapes.
    H: tl.constexpr, I: tl.constexpr, I_S: tl.constexpr,
    E: tl.constexpr, E_L: tl.constexpr, TOP_K: tl.constexpr, W: tl.constexpr, T_MAX: tl.constexpr,
    TILE_CAP: tl.constexpr,
    # Router.
    SIGMOID_GROUP: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM_TOPK: tl.constexpr, ROUTER_PRECISION: tl.constexpr,
    # Workspace layout: int32 word indices, and byte offsets for the other regions.
    C_SEND_CNT: tl.constexpr, C_TABLE: tl.constexpr, C_FLAG: tl.constexpr, C_ARRIVED: tl.constexpr,
    C_GU_DONE: tl.constexpr, C_COMB_ARR: tl.constexpr, C_SEND_LIST: tl.constexpr,
    C_TOPK_E: tl.constexpr, C_RECV_SRC: tl.constexpr, C_RECV_ENT: tl.constexpr, C_WORDS: tl.constexpr,
    B_TOPK_W: tl.constexpr, B_RECV_W: tl.constexpr, B_RECV_X: tl.constexpr, B_H_R: tl.constexpr,
    B_H_S: tl.constexpr, B_COMB: tl.constexpr,
    # Tiles.
    BT: tl.constexpr, BK_R: tl.constexpr, R_STAGES: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
    BM: tl.constexpr, BN_GU: tl.constexpr, BN_DN: tl.constexpr, BK: tl.constexpr, BTF: tl.constexpr,
    BHF: tl.constexpr, STAGES: tl.constexpr, DN_STAGES: tl.constexpr,
    TMA: tl.constexpr, ROWS_ALIGNED: tl.constexpr, GU_ONE_DOT: tl.constexpr, HELD_CHUNK_FIRST: tl.constexpr,
    MERGED_LOOKUP: tl.constexpr, GU_CLAIM_AHEAD: tl.constexpr,
    # Padded sizes for index vectors.
    E_PAD: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr,
    G_PAD: tl.constexpr, O_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SCOPE: tl.constexpr, PROFILE: tl.constexpr,
):
    DT = x_ptr.dtype.element_ty
    SLOTS: tl.constexpr = TOP_K + (1 if I_S > 0 else 0)
    N_IB: tl.constexpr = (I + BN_GU - 1) // BN_GU
    N_IB_S: tl.constexpr = (I_S + BN_GU - 1) // BN_GU
    N_HB: tl.constexpr = (H + BN_DN - 1) // BN_DN
    EXPECT_PER_TOKEN: tl.constexpr = SLOTS * N_HB

    ctl = peer_ptr(peers_ptr, me, 0, tl.int32)
    heads = ctl + C_HEADS
    err = ctl + C_ERR
    abort = ctl + C_ABORT
    topk_w = peer_ptr(peers_ptr, me, B_TOPK_W, tl.float32)
    recv_w = peer_ptr(peers_ptr, me, B_RECV_W, tl.float32)
    recv_x = peer_ptr(peers_ptr, me, B_RECV_X, DT)
    h_r = peer_ptr(peers_ptr, me, B_H_R, DT)
    h_s = peer_ptr(peers_ptr, me, B_H_S, DT)
    comb = peer_ptr(peers_ptr, me, B_COMB, DT)

    epoch = tl.load(ctl + C_EPOCH) + 1
    par = epoch % 2
    n_route = tl.cdiv(n_tokens, BT)
    n_feed = n_route + 1 + tl.cdiv(n_tokens * TOP_K, BR) + E
    SHARED: tl.constexpr = 1 if I_S > 0 else 0
    n_tiles_s = tl.cdiv(n_tokens, BM) * SHARED
    n_sgu = n_tiles_s * N_IB_S
    n_sdn = n_tiles_s * N_HB
    n_fold = tl.cdiv(n_tokens, BTF)

    w_idx = tl.arange(0, W_PAD)
    el_idx = tl.arange(0, EL_PAD)

    t_start = now() if PROFILE else 0
    running = 1
    idle = 0
    ran_gate_up = 0  # PROFILE: whether this worker has run a routed gate/up tile yet
    held_gu = -1   # the ticket this worker holds in each claimed-by-ticket queue (-1: none)
    held_dn = -1
    held_sdn = -1
    held_f = -1
    held_feed = -1  # a dispatch chunk taken before every rank's counts were in
    # Bit q set: queue q may still have unclaimed tasks. A worker clears it when it finds the
    # queue's head at its end (the task counts are fixed once the counts are known), and then
    # skips the queue: every pass of a short task would otherwise pay a round trip per queue.
    open_q = ALL_OPEN
    # What this rank receives: read every pass until every peer's counts are in, then kept
    # (peers write the next call's counts into the other parity).
    known = tl.sum(w_idx, axis=0) < 0  # false; a tensor, since it is carried by the loop
    flags = tl.zeros([W_PAD], dtype=tl.int32)
    n_el, tiles_el, tile_start_el, row_start_el, cum_gu, cum_dn, n_gu, n_dn = expert_tasks(
        tl.zeros([W_PAD, EL_PAD], dtype=tl.int32), BM, N_IB, N_HB)
    while running > 0:
        t_pass = now() if PROFILE else 0
        did = 0  # the kind of task this pass ran (0: none); see PROFILE_SLOTS
        if known == 0:
            known, flags, table = poll_counts(ctl, epoch, par, me, W, W_PAD, E, E_L, EL_PAD, C_FLAG, C_TABLE, SCOPE)
            n_el, tiles_el, tile_start_el, row_start_el, cum_gu, cum_dn, n_gu, n_dn = expert_tasks(table, BM, N_IB, N_HB)
        # A dispatch chunk held from before the counts were in, now runnable: it goes ahead of
        # every tile (Tiles.held_chunk_first), since its expert's gate/up tiles, and all that
        # follows them, wait for it. ``did`` -1 makes every section but FEED skip this pass.
        if HELD_CHUNK_FIRST:
            did = tl.where((held_feed >= 0) & (known != 0), -1, 0)

        # ---- FOLD ----
        # Looked at once this worker has found the DOWN queue taken to its end: a block's rows
        # come from down tiles all along that queue, so a look before then is one wasted round
        # trip in every pass of every task.
        f = held_f
        if ((open_q & OPEN_DOWN) == 0) & (did == 0):
            f, open_q = _claim(heads + Q_FOLD, held_f, n_fold, open_q, OPEN_FOLD)
        if (f >= 0) & (did == 0):
            toks = f * BTF + tl.arange(0, BTF)
            tok_ok = toks < n_tokens
            arr = tl.atomic_add(ctl + C_COMB_ARR + w_idx[:, None] * T_MAX + toks[None, :], 0,
                                mask=(w_idx[:, None] < W) & tok_ok[None, :], sem="acquire", scope=SCOPE)
            got = tl.sum(arr, axis=0)
            if tl.sum(((got != EXPECT_PER_TOKEN) & tok_ok).to(tl.int32), axis=0) == 0:
                tl.debug_barrier()
                fold_block(comb, out_ptr, toks, tok_ok, tok_ok, H, SLOTS, SLOTS, BTF, BHF, K_PAD, False)
                did = 8
                f = -1

        held_f = f

        # ---- DOWN (routed) ----
        if did == 0:
            q = held_dn
            if known:
                q, open_q = _claim(heads + Q_DOWN, held_dn, n_dn, open_q, OPEN_DOWN)
            if q >= 0:
                # MERGED_LOOKUP (from 256 local experts, Tiles.merged_lookup_from) reads an
                # expert's four entries in one reduction up front; below that each is picked
                # where first needed, some only once the task is ready (here and in GATE_UP).
                if MERGED_LOOKUP:
                    e, first, n_rows_e, n_tiles_e, tile_start_e, row_start_e = locate_expert(
                        cum_dn, el_idx, q, n_el, tiles_el, tile_start_el, row_start_el, N_HB)
                else:
                    e, first = _locate(cum_dn, el_idx, q)
                    n_rows_e = _pick(n_el, el_idx, e)
                    n_tiles_e = _pick(tiles_el, el_idx, e)
                local = q - first
                hb = local // n_tiles_e
                m = local % n_tiles_e
                if not MERGED_LOOKUP:
                    tile_start_e = _pick(tile_start_el, el_idx, e)
                tile = tile_start_e + m
                if tl.atomic_add(ctl + C_GU_DONE + tile, 0, sem="acquire", scope="gpu") == N_IB:
                    tl.debug_barrier()
                    # The next ticket, taken now: its round trip overlaps this tile (see
                    # "Claiming" above for why holding it while running this one is safe).
                    nxt = take_ticket(heads + Q_DOWN, open_q, OPEN_DOWN)
                    if not MERGED_LOOKUP:
                        row_start_e = _pick(row_start_el, el_idx, e)
                    row0 = row_start_e + m * BM
                    n_rows = tl.minimum(n_rows_e - m * BM, BM)
                    routed_down_rows(h_r, row0, n_rows, e, hb, w_down_ptr, w_down_desc, recv_w, ctl, peers_ptr, me,
                                     H, I, TOP_K, SLOTS, T_MAX, W, C_RECV_SRC, C_RECV_ENT, C_COMB_ARR, B_COMB,
                                     BM, BN_DN, BK, DOT_DTYPE, DN_STAGES, TMA, SCOPE, PROFILE, profile_ptr)
                    q, open_q = settle_ticket(nxt, n_dn, open_q, OPEN_DOWN)
                    did = 5
            held_dn = q

        # ---- SDOWN (shared expert) ----
        if did == 0:
            # Claimed once this worker has found the SGATE_UP queue taken to its end: a row
            # tile's shared gate/up tiles lie all along that queue (row tile fastest).
            q = held_sdn
            if (open_q & OPEN_SGATE_UP) == 0:
                q, open_q = _claim(heads + Q_SDOWN, held_sdn, n_sdn, open_q, OPEN_SDOWN)
            if q >= 0:
                hb = q // n_tiles_s
                m = q % n_tiles_s
                if tl.atomic_add(ctl + C_GU_DONE + TILE_CAP + m, 0, sem="acquire", scope="gpu") == N_IB_S:
                    tl.debug_barrier()
                    t0 = m * BM
                    n_rows = tl.minimum(n_tokens - t0, BM)
                    if TMA:
                        acc = down_tile_tma_w(h_s + t0.to(tl.int64) * I_S, n_rows, s_down_desc, 0, hb * BN_DN,
                                              I_S, BM, BN_DN, BK, DOT_DTYPE, DN_STAGES)
                    else:
                        acc = down_tile(h_s + t0.to(tl.int64) * I_S, n_rows, s_down_ptr, hb * BN_DN,
                                        I_S, H, BM, BN_DN, BK, DOT_DTYPE, DN_STAGES)
                    toks = t0 + tl.arange(0, BM)
                    row_ok = tl.arange(0, BM) < n_rows
                    cols = hb * BN_DN + tl.arange(0, BN_DN)
                    dst = comb + (toks.to(tl.int64) * SLOTS + TOP_K)[:, None] * H + cols[None, :]
                    tl.store(dst, acc.to(DT), mask=row_ok[:, None] & (cols < H)[None, :])
                    signal_add(ctl + C_COMB_ARR + me * T_MAX + toks, tl.where(row_ok, 1, 0), "gpu")
                    q = -1
                    did = 7
            held_sdn = q

        # ---- GATE_UP (routed) ----
        if did == 0:
            g = held_gu
            if known:
                g, open_q = _claim(heads + Q_GATE_UP, held_gu, n_gu, open_q, OPEN_GATE_UP)
            if g >= 0:
                if MERGED_LOOKUP:
                    e, first, n_rows_e, n_tiles_e, tile_start_e, row_start_e = locate_expert(
                        cum_gu, el_idx, g, n_el, tiles_el, tile_start_el, row_start_el, N_IB)
                else:
                    e, first = _locate(cum_gu, el_idx, g)
                    n_rows_e = _pick(n_el, el_idx, e)
                arrived = tl.atomic_add(ctl + C_ARRIVED + w_idx * E_L + e, 0, mask=w_idx < W,
                                        sem="acquire", scope=SCOPE)
                if tl.sum(tl.where(w_idx < W, arrived, 0), axis=0) == n_rows_e:
                    tl.debug_barrier()
                    if GU_CLAIM_AHEAD:
                        nxt = take_ticket(heads + Q_GATE_UP, open_q, OPEN_GATE_UP)  # the next ticket (as in DOWN)
                    if not MERGED_LOOKUP:
                        n_tiles_e = _pick(tiles_el, el_idx, e)
                    local = g - first
                    ib = local // n_tiles_e
                    m = local % n_tiles_e
                    if not MERGED_LOOKUP:
                        row_start_e = _pick(row_start_el, el_idx, e)
                    row0 = row_start_e + m * BM
                    n_rows = tl.minimum(n_rows_e - m * BM, BM)
                    routed_gate_up_rows(x_ptr, recv_x, ctl, me, row0, n_rows, e, ib, w_gate_up_ptr, w_gate_up_desc,
                                        h_r, saved_ptr, slot_ptr, save_cap, H, I, TOP_K, T_MAX, C_RECV_SRC, C_RECV_ENT,
                                        BM, BN_GU, BK, DOT_DTYPE, STAGES, TMA, ROWS_ALIGNED, GU_ONE_DOT,
                                        PROFILE, profile_ptr)
                    if not MERGED_LOOKUP:
                        tile_start_e = _pick(tile_start_el, el_idx, e)
                    signal_add(ctl + C_GU_DONE + tile_start_e + m, 1, "gpu")
                    if GU_CLAIM_AHEAD:
                        g, open_q = settle_ticket(nxt, n_gu, open_q, OPEN_GATE_UP)
                    else:
                        g = -1
                    did = 4
            held_gu = g

        # ---- FEED: route tiles, count exchange, dispatch chunks ----
        if did <= 0:
            did = 0
            a, open_q = _claim(heads + Q_FEED, held_feed, n_feed, open_q, OPEN_FEED)
            if (a > n_route) & (known == 0):
                # A dispatch chunk before every rank's counts are in: keep the ticket and
                # fill the wait with the shared expert's tiles below (it was a spin in place).
                held_feed = a
                a = -1
            else:
                held_feed = -1
            if a >= 0:
                if a < n_route:
                    # Route tile: logits, top-k, and this rank's send lists.
                    t0 = a * BT
                    n_rows = tl.minimum(n_tokens - t0, BT)
                    logits = router_logits(x_ptr + t0.to(tl.int64) * H, n_rows, router_w_ptr,
                                           H, E, BT, E_PAD, BK_R, R_STAGES, ROUTER_PRECISION)
                    toks = t0 + tl.arange(0, BT)
                    tok_ok = tl.arange(0, BT) < n_rows
                    if save_logits:
                        ecols = tl.arange(0, E_PAD)
                        tl.store(logits_ptr + toks.to(tl.int64)[:, None] * E + ecols[None, :], logits,
                                 mask=tok_ok[:, None] & (ecols < E)[None, :])
                    experts, weights = top_k_routing(logits, bias_ptr, scale, E, E_PAD, TOP_K,
                                                     SIGMOID_GROUP, N_GROUP, TOPK_GROUP, G_PAD,
                                                     K_PAD, NORM_TOPK)
                    kk = tl.arange(0, K_PAD)
                    ok = tok_ok[:, None] & (kk < TOP_K)[None, :]
                    ent = toks[:, None] * TOP_K + kk[None, :]
                    tl.store(ctl + C_TOPK_E + ent, experts, mask=ok)
                    tl.store(topk_w + ent, weights, mask=ok)
                    pos = tl.atomic_add(ctl + C_SEND_CNT + experts, 1, mask=ok, sem="relaxed", scope="gpu")
                    tl.store(ctl + C_SEND_LIST + experts.to(tl.int64) * T_MAX + pos, ent, mask=ok)
                    signal_add(ctl + C_ROUTE_DONE, 1, "gpu")
                elif a == n_route:
                    # Count exchange: publish this rank's counts to every rank, itself included.
                    done = tl.atomic_add(ctl + C_ROUTE_DONE, 0, sem="acquire", scope="gpu")
                    polls = 0
                    while (done != n_route) & (polls <= wait_bound):
                        done = tl.atomic_add(ctl + C_ROUTE_DONE, 0, sem="acquire", scope="gpu")
                        polls += 1
                    if done != n_route:
                        record_error(err, abort, ERR_ROUTE, me, a, me, 0, n_route, done)
                    else:
                        tl.debug_barrier()
                        e_idx = tl.arange(0, E_PAD)
                        counts = tl.load(ctl + C_SEND_CNT + e_idx, mask=e_idx < E, other=0)
                        for dst in tl.static_range(W):
                            peer_table = peer_ptr(peers_ptr, dst, (C_TABLE + par * W * E + me * E) * 4, tl.int32)
                            tl.store(peer_table + e_idx, counts, mask=e_idx < E)
                        tl.debug_barrier()
                        for dst in tl.static_range(W):
                            tl.atomic_xchg(peer_ptr(peers_ptr, dst, (C_FLAG + me) * 4, tl.int32), epoch,
                                           sem="release", scope=SCOPE)
                else:
                    # Dispatch chunk (every rank's counts are in): copy rows.
                    dispatch_chunk(ctl, peers_ptr, me, par, a - n_route - 1, x_ptr, x_ptr, topk_w,
                                   W, W_PAD, E, E_L, EL_PAD, O_PAD, TOP_K, T_MAX, H, BR, BH,
                                   C_TABLE, C_SEND_LIST, C_RECV_SRC, C_RECV_ENT, C_ARRIVED,
                                   B_RECV_X, B_RECV_X, B_RECV_W, False, False, SCOPE)
                did = 1 + (a > n_route) + (a > n_route + 1)  # route 1, count 2, dispatch 3

        # ---- SGATE_UP (shared expert): always ready, so it fills idle time ----
        if did == 0:
            g, open_q = _claim(heads + Q_SGATE_UP, -1, n_sgu, open_q, OPEN_SGATE_UP)
            if g >= 0:
                ib = g // n_tiles_s
                m = g % n_tiles_s
                t0 = m * BM
                s_rows = x_ptr + (t0 + tl.arange(0, BM)).to(tl.int64) * H
                n_rows = tl.minimum(n_tokens - t0, BM)
                if TMA:
                    acc_g, acc_u = gate_up_acc_tma(s_rows, n_rows, s_gate_desc, 0, s_up_desc, 0, ib * BN_GU,
                                                   H, BM, BN_GU, BK, DOT_DTYPE, STAGES)
                else:
                    acc_g, acc_u = gate_up_acc(s_rows, n_rows, s_gate_ptr, s_up_ptr, ib * BN_GU,
                                               H, I_S, BM, BN_GU, BK, DOT_DTYPE, STAGES)
                rows = tl.arange(0, BM)
                row_ok = rows < n_rows
                cols = ib * BN_GU + tl.arange(0, BN_GU)
                store_swiglu(acc_g, acc_u, h_s + t0.to(tl.int64) * I_S, rows, cols, row_ok, I_S)
                if save_shared != 0:  # a training call: the shared experts' backward reads these
                    store_gate_up(acc_g, acc_u, s_saved_ptr + t0.to(tl.int64) * (2 * I_S), rows, cols, row_ok, I_S)
                signal_add(ctl + C_GU_DONE + TILE_CAP + m, 1, "gpu")
                did = 6

        # ---- Nothing taken: finished, aborted, or waiting. ----
        if did == 0:
            # A pass that ran nothing visited every queue, so open_q is current.
            finished = ((open_q == 0) & known & (held_gu < 0) & (held_dn < 0) & (held_sdn < 0) & (held_f < 0)
                        & (held_feed < 0))
            if tl.atomic_add(abort, 0, sem="relaxed") != 0:
                # Checked only here: a worker that keeps finding ready work needs no look at the
                # flag (one round trip a task), and after an abort it soon finds none.
                running = 0
            elif finished:
                running = 0
            else:
                idle += 1
                if idle > wait_bound:
                    # Name the earliest thing this rank is still waiting for.
                    if known == 0:
                        record_missing_counts(err, abort, me, -1, flags, epoch, W, W_PAD)
                    elif held_gu >= 0:
                        e, first = _locate(cum_gu, el_idx, held_gu)
                        arrived = tl.atomic_add(ctl + C_ARRIVED + w_idx * E_L + e, 0, mask=w_idx < W,
                                                sem="acquire", scope=SCOPE)
                        record_error(err, abort, ERR_ROWS, me, held_gu, -1, e, _pick(n_el, el_idx, e),
                                     tl.sum(tl.where(w_idx < W, arrived, 0), axis=0))
                    elif held_dn >= 0:
                        record_error(err, abort, ERR_GATE_UP, me, held_dn, -1, 0, N_IB, 0)
                    elif held_sdn >= 0:
                        record_error(err, abort, ERR_SHARED, me, held_sdn, -1, 0, N_IB_S, 0)
                    else:
                        f = tl.where(held_f >= 0, held_f, tl.atomic_add(heads + Q_FOLD, 0, sem="relaxed"))
                        toks = f * BTF + tl.arange(0, BTF)
                        tok_ok = toks < n_tokens
                        arr = tl.atomic_add(ctl + C_COMB_ARR + w_idx[:, None] * T_MAX + toks[None, :], 0,
                                            mask=(w_idx[:, None] < W) & tok_ok[None, :], sem="acquire", scope=SCOPE)
                        got = tl.sum(arr, axis=0)
                        bad = tl.min(tl.where((got != EXPECT_PER_TOKEN) & tok_ok, toks, n_tokens), axis=0)
                        record_error(err, abort, ERR_COMBINE, me, f, -1, bad, EXPECT_PER_TOKEN,
                                     _pick(got, toks, bad))
        else:
            idle = 0
        if PROFILE:
            t_spent = now() - t_pass
            tl.atomic_add(profile_ptr + did, t_spent, sem="relaxed")
            tl.atomic_add(profile_ptr + 16 + did, 1, sem="relaxed")
            if (did == 0) & (running > 0):
                why = tl.where(held_gu >= 0, PROFILE_IDLE_GATE_UP,
                               tl.where(held_dn >= 0, PROFILE_IDLE_DOWN,
                                        tl.where((held_f >= 0) | (held_sdn >= 0), PROFILE_IDLE_TAIL,
                                                 PROFILE_IDLE_NOTHING)))
                tl.atomic_add(profile_ptr + why, t_spent, sem="relaxed")
                tl.atomic_add(profile_ptr + 16 + why, 1, sem="relaxed")
                if (held_gu >= 0) & (ran_gate_up != 0):
                    tl.atomic_add(profile_ptr + PROFILE_IDLE_GATE_UP_LATE, t_spent, sem="relaxed")
                    tl.atomic_add(profile_ptr + 16 + PROFILE_IDLE_GATE_UP_LATE, 1, sem="relaxed")
            if did == 4:
                ran_gate_up = 1

    if PROFILE:
        record_worker_span(profile_ptr, t_start)

    # ---- Leave; the last worker out resets the counters for the next call. ----
    tl.debug_barrier()
    if tl.atomic_add(ctl + C_EXIT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        if tl.atomic_add(abort, 0, sem="relaxed") == 0:
            RESET: tl.constexpr = 1024
            for w0 in tl.range(C_SEND_CNT, C_SEND_CNT + E, RESET):   # send counts (the table is kept)
                idx = w0 + tl.arange(0, RESET)
                tl.store(ctl + idx, tl.zeros([RESET], tl.int32), mask=idx < C_SEND_CNT + E)
            for w0 in tl.range(C_ARRIVED, C_SEND_LIST, RESET):  # arrivals, gate/up tiles, combine
                idx = w0 + tl.arange(0, RESET)
                tl.store(ctl + idx, tl.zeros([RESET], tl.int32), mask=idx < C_SEND_LIST)
            heads_idx = tl.arange(0, 8)
            tl.store(ctl + C_HEADS + heads_idx, tl.zeros([8], tl.int32))
            tl.store(ctl + C_ROUTE_DONE, 0)
            tl.store(ctl + C_EXIT, 0)
            tl.debug_barrier()
            tl.store(ctl + C_EPOCH, epoch)
