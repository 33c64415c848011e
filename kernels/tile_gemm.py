"""Tile GEMMs of the SwiGLU experts: one output tile per call, fp32 accumulation.

Weights are in the Hugging Face layout, output-major with the reduction dimension contiguous
(``gate``/``up`` ``[I, H]``, ``down`` ``[H, I]``), so a ``[BK, BN]`` operand tile is the
transpose of a row-major block; ``tl.dot`` takes it as is.

``DOT_DTYPE`` is the operand type handed to ``tl.dot``: the activation dtype on the GPU, and
fp32 under the interpreter, whose bf16 ``tl.dot`` is wrong (DESIGN.md).
"""

import triton
import triton.language as tl

from .profile import now


@triton.jit
def store_swiglu(acc_g, acc_u, h_ptr, rows, cols, row_ok, N_DIM: tl.constexpr):
    """The gate/up tiles' epilogue: ``h[rows, cols] = silu(acc_g) * acc_u`` in ``h``'s dtype, masked."""
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = h_ptr + rows.to(tl.int64)[:, None] * N_DIM + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N_DIM)[None, :])


@triton.jit
def store_gate_up(acc_g, acc_u, out_ptr, rows, cols, keep, N_DIM: tl.constexpr):
    """Keep a gate/up tile's projections for the backward: ``out[rows] = [acc_g | acc_u]``
    (rows ``2 N_DIM`` wide, gate first) where ``keep``, in ``out``'s dtype."""
    mask = keep[:, None] & (cols < N_DIM)[None, :]
    at = out_ptr + rows.to(tl.int64)[:, None] * (2 * N_DIM) + cols[None, :]
    tl.store(at, acc_g.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(at + N_DIM, acc_u.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gate_up_acc(
    a_rows, n_rows, w_gate_ptr, w_up_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """Return the fp32 tiles ``(a @ Wg[n0:n0+BN]^T, a @ Wu[n0:n0+BN]^T)``; ``a_rows`` points at each row of ``a``.

    The rows of ``a`` are gathered (a ``[BM]`` vector of row pointers), so a tile can read
    received rows and rows still in the caller's input alike.
    """
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < N_DIM
    a_rows = a_rows[:, None]
    wg_cols = w_gate_ptr + cols.to(tl.int64)[None, :] * K_DIM
    wu_cols = w_up_ptr + cols.to(tl.int64)[None, :] * K_DIM
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        k_ok = (k0 + ks) < K_DIM
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(wg_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(wu_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a = a.to(DOT_DTYPE)
        acc_g = tl.dot(a, bg.to(DOT_DTYPE), acc_g)
        acc_u = tl.dot(a, bu.to(DOT_DTYPE), acc_u)
    return acc_g, acc_u


@triton.jit
def column_halves(tile, BM: tl.constexpr, HALF: tl.constexpr):
    """The left and right ``[BM, HALF]`` column halves of a ``[BM, 2 HALF]`` tile.

    In a wgmma accumulator a thread holds column ``c`` and column ``c + HALF`` alike, so the
    reshape, permute and split move no data (no layout conversion in the sm_90 compile).
    """
    return tl.split(tl.permute(tl.reshape(tile, [BM, 2, HALF]), (0, 2, 1)))


@triton.jit
def gate_up_pair_acc(
    a_rows, n_rows, w_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``gate_up_acc`` for one expert's ``[2 N_DIM, K_DIM]`` gate/up weight (gate rows first) as
    one dot of ``2 BN`` columns per step: the gate block and the up block side by side.

    One ``BM x 2BN`` dot reads the row block once per step where two ``BM x BN`` dots read it
    twice, and issues half the wgmma instructions (``m64n256k16`` at 128 columns).
    """
    rows = tl.arange(0, BM)
    pair = tl.arange(0, 2 * BN)
    cols = n0 + pair % BN
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < N_DIM
    a_rows = a_rows[:, None]
    w_cols = w_ptr + ((pair // BN) * N_DIM + cols).to(tl.int64)[None, :] * K_DIM
    acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        k_ok = (k0 + ks) < K_DIM
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
    return column_halves(acc, BM, BN)  # [gate | up]


@triton.jit
def gate_up_tile(
    a_rows, n_rows, w_gate_ptr, w_up_ptr, h_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``h[:n_rows, n0:n0+BN] = silu(a @ Wg^T) * (a @ Wu^T)`` (``gate_up_acc`` and its epilogue)."""
    acc_g, acc_u = gate_up_acc(a_rows, n_rows, w_gate_ptr, w_up_ptr, n0, K_DIM, N_DIM, BM, BN, BK, DOT_DTYPE, STAGES)
    rows = tl.arange(0, BM)
    store_swiglu(acc_g, acc_u, h_ptr, rows, n0 + tl.arange(0, BN), rows < n_rows, N_DIM)


@triton.jit
def down_tile(
    h_ptr, n_rows, w_down_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """Return the fp32 tile ``h[:BM] @ Wd[n0:n0+BN]^T`` (rows past ``n_rows`` are zero)."""
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < N_DIM
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * K_DIM
    w_cols = w_down_ptr + cols.to(tl.int64)[None, :] * K_DIM
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        k_ok = (k0 + ks) < K_DIM
        a = tl.load(h_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
    return acc


@triton.jit
def swiglu_backward_tile(
    x_rows, g_rows, n_rows, w_gate_ptr, w_up_ptr, w_down_ptr, n0,
    H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """Return fp32 ``(g @ Wd[:, n0:n0+BN], x @ Wg[n0:n0+BN]^T, x @ Wu[n0:n0+BN]^T)``.

    ``x_rows`` and ``g_rows`` point at each row of the expert's input and of its (unweighted)
    output gradient. One pass over ``H`` feeds all three products: the gradient of the SwiGLU
    activation and the recomputed gate and up projections it needs.
    """
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < I
    x_rows = x_rows[:, None]
    g_rows = g_rows[:, None]
    wg_cols = w_gate_ptr + cols.to(tl.int64)[None, :] * H
    wu_cols = w_up_ptr + cols.to(tl.int64)[None, :] * H
    wd_cols = w_down_ptr + cols[None, :]
    acc_dh = tl.zeros([BM, BN], dtype=tl.float32)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, H, BK, num_stages=STAGES):
        k_ok = (k0 + ks) < H
        a_mask = row_ok[:, None] & k_ok[None, :]
        b_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=a_mask, other=0.0).to(DOT_DTYPE)
        dy = tl.load(g_rows + (k0 + ks)[None, :], mask=a_mask, other=0.0).to(DOT_DTYPE)
        bg = tl.load(wg_cols + (k0 + ks)[:, None], mask=b_mask, other=0.0).to(DOT_DTYPE)
        bu = tl.load(wu_cols + (k0 + ks)[:, None], mask=b_mask, other=0.0).to(DOT_DTYPE)
        bd = tl.load(wd_cols + (k0 + ks).to(tl.int64)[:, None] * I, mask=b_mask, other=0.0).to(DOT_DTYPE)
        acc_dh = tl.dot(dy, bd, acc_dh)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    return acc_dh, acc_g, acc_u


@triton.jit
def rows_times_weight_tile(
    a_ptr, n_rows, w_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr = False,
):
    """Return the fp32 tile ``a[:BM] @ W[:, n0:n0+BN]`` for a row-major ``W`` ``[K_DIM, N_DIM]``
    and ``n_rows >= 1`` contiguous rows of ``a``.

    ``TMA``: both operands through descriptors made here (``a`` over exactly ``n_rows`` rows,
    so the copy engine zero-fills the rest of the tile); needs 16-byte aligned bases and row
    strides (see ``row_reduction_strip``).
    """
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < N_DIM
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K_DIM
    w_cols = w_ptr + cols[None, :]
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[n_rows, K_DIM], strides=[K_DIM, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K_DIM, N_DIM], strides=[N_DIM, 1], block_shape=[BK, BN])
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        if TMA:
            a = a_desc.load([0, k0])
            b = w_desc.load([k0, n0])
        else:
            k_ok = (k0 + ks) < K_DIM
            a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + (k0 + ks).to(tl.int64)[:, None] * N_DIM, mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
    return acc


# TMA variants. The weight operand comes through a tensor descriptor over all experts' rows
# (``[E * rows_per_expert, K]``, block ``[BN, BK]``): the copy engine fetches the tile into
# shared memory, so the workers spend no registers or instructions on its addresses and masks.
# Columns past K are zero-filled by the hardware. A block that runs past an expert's last row
# reads the next expert's rows (or zeros past the last one); those only reach output columns
# that the store masks off.


@triton.jit
def gate_up_acc_tma(
    a_rows, n_rows, g_desc, g_row0, u_desc, u_row0, n0,
    K_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``gate_up_acc`` with the gate and up weight blocks at rows ``g_row0 + n0`` of ``g_desc`` and ``u_row0 + n0`` of ``u_desc``."""
    rows = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    a_rows = a_rows[:, None]
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K_DIM)[None, :], other=0.0)
        bg = g_desc.load([g_row0 + n0, k0])
        bu = u_desc.load([u_row0 + n0, k0])
        a = a.to(DOT_DTYPE)
        acc_g = tl.dot(a, bg.to(DOT_DTYPE).T, acc_g)
        acc_u = tl.dot(a, bu.to(DOT_DTYPE).T, acc_u)
    return acc_g, acc_u


@triton.jit
def gate_up_pair_acc_tma(
    a_rows, n_rows, w_desc, pair0, n0,
    K_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``gate_up_pair_acc`` with the weight blocks by TMA: ``w_desc`` views the gate/up weights
    as ``[2 E, N_DIM, K_DIM]`` (expert ``e``'s gate at ``2e``, its up at ``2e + 1``) with block
    ``[2, BN, BK]``, so one copy brings both blocks, stacked, and ``pair0 = 2e``. Rows past
    ``N_DIM`` within a half are zero-filled by the copy engine, never the other half's.
    """
    rows = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    a_rows = a_rows[:, None]
    acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K_DIM)[None, :], other=0.0)
        b = w_desc.load([pair0, n0, k0]).reshape([2 * BN, BK])
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE).T, acc)
    return column_halves(acc, BM, BN)  # [gate | up]


@triton.jit
def gate_up_tile_tma(
    a_rows, n_rows, g_desc, g_row0, u_desc, u_row0, h_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``gate_up_tile`` with the weight blocks by TMA (``gate_up_acc_tma`` and its epilogue)."""
    acc_g, acc_u = gate_up_acc_tma(a_rows, n_rows, g_desc, g_row0, u_desc, u_row0, n0, K_DIM, BM, BN, BK,
                                   DOT_DTYPE, STAGES)
    rows = tl.arange(0, BM)
    store_swiglu(acc_g, acc_u, h_ptr, rows, n0 + tl.arange(0, BN), rows < n_rows, N_DIM)


@triton.jit
def down_tile_tma(
    a_desc, a_row0, w_desc, w_row0, n0,
    K_DIM: tl.constexpr, BK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """Return the fp32 tile ``a[a_row0:a_row0+BM] @ W[w_row0+n0 : +BN]^T``, both operands by TMA.

    Rows of ``a`` past the tile's own come from the next tile (or are zero past the end): the
    caller masks those rows off.
    """
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        a = a_desc.load([a_row0, k0])
        b = w_desc.load([w_row0 + n0, k0])
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE).T, acc)
    return acc


@triton.jit
def gate_up_tile_tma_rows(
    a_desc, a_row0, n_rows, w_desc, gate_row0, up_row0, h_ptr, n0,
    K_DIM: tl.constexpr, N_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``gate_up_tile_tma`` on contiguous rows ``a[a_row0 : a_row0 + n_rows]``, read by TMA too."""
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        a = a_desc.load([a_row0, k0]).to(DOT_DTYPE)
        bg = w_desc.load([gate_row0 + n0, k0])
        bu = w_desc.load([up_row0 + n0, k0])
        acc_g = tl.dot(a, bg.to(DOT_DTYPE).T, acc_g)
        acc_u = tl.dot(a, bu.to(DOT_DTYPE).T, acc_u)
    store_swiglu(acc_g, acc_u, h_ptr, rows, cols, rows < n_rows, N_DIM)


@triton.jit
def down_tile_tma_w(
    a_ptr, n_rows, w_desc, w_row0, n0,
    K_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr,
):
    """``down_tile`` with only the weight block by TMA: rows of ``a`` (written in this launch)
    by plain loads, which need no ordering with the copy engine's reads."""
    rows = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K_DIM
    row_ok = rows < n_rows
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K_DIM, BK, num_stages=STAGES):
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K_DIM)[None, :], other=0.0)
        b = w_desc.load([w_row0 + n0, k0])
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE).T, acc)
    return acc


@triton.jit
def _store_block(out_ptr, mcols, m_ok, ncols, N_DIM, block, EVICT_FIRST: tl.constexpr = False):
    """``out[mcols, ncols] = block`` in ``out``'s dtype, inside ``[M_DIM, N_DIM]`` (``m_ok``);
    ``EVICT_FIRST``: with an L2 evict-first policy (a result no one reads in this launch)."""
    tl.store(out_ptr + mcols.to(tl.int64)[:, None] * N_DIM + ncols[None, :], block.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (ncols < N_DIM)[None, :], eviction_policy="evict_first" if EVICT_FIRST else "")


@triton.jit
def _strip_operands(a_ptr, b_ptr, a_desc, b_desc, n_rows, m0, mcols, m_ok, s, blk, M_DIM, N_DIM,
                    BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, TMA: tl.constexpr):
    """Row step ``s`` of column block ``blk``: ``a[rows, m-block]^T`` and ``b[rows, n-block]``."""
    if TMA:
        at = a_desc.load([s * BK, m0])
        b = b_desc.load([s * BK, blk * BN])
    else:
        rows = s * BK + tl.arange(0, BK)
        row_ok = rows < n_rows
        r64 = rows.to(tl.int64)[:, None]
        ncols = blk * BN + tl.arange(0, BN)
        at = tl.load(a_ptr + r64 * M_DIM + mcols[None, :], mask=row_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(b_ptr + r64 * N_DIM + ncols[None, :], mask=row_ok[:, None] & (ncols < N_DIM)[None, :], other=0.0)
    return tl.trans(at.to(DOT_DTYPE)), b.to(DOT_DTYPE)


@triton.jit
def _strip_store(out_ptr, o_desc, m0, mcols, m_ok, blk, N_DIM, acc, BN: tl.constexpr, TMA_STORE: tl.constexpr,
                 EVICT_FIRST: tl.constexpr):
    if TMA_STORE:
        o_desc.store([m0, blk * BN], acc.to(out_ptr.dtype.element_ty))
    else:
        _store_block(out_ptr, mcols, m_ok, blk * BN + tl.arange(0, BN), N_DIM, acc, EVICT_FIRST)


@triton.jit
def row_reduction_strip(
    a_ptr, b_ptr, out_ptr, n_rows, m0, blk0, M_DIM, N_DIM,
    STRIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr, ALIGNED: tl.constexpr, TMA: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False, BLOCK_LOOPS: tl.constexpr = False,
    PROFILE: tl.constexpr = False, epilogue_ns=None, EVICT_FIRST: tl.constexpr = False,
):
    """``out[m0:m0+BM, n-block] = a[:n_rows, m0:m0+BM]^T @ b[:n_rows, n-block]`` for ``STRIP``
    consecutive ``BN``-column blocks from ``blk0`` (fewer at the right edge).

    ``a`` ``[n_rows, M_DIM]``, ``b`` ``[n_rows, N_DIM]`` and ``out`` ``[M_DIM, N_DIM]`` are
    row-major. Each block reduces over the rows in order (deterministic). ``n_rows == 0``
    writes zeros.

    Without ``BLOCK_LOOPS`` the blocks and their row steps run as one flat loop, so the software
    pipeline carries across block boundaries: the next block's first loads are in flight during
    this block's store, where per-block loops each pay a pipeline fill and a drain. In the fused
    backward (sm_90, Triton 3.6) that flat loop is what holds registers: beside it no other
    256-column tile compiles without ptxas serializing the kernel's wgmma (C7512). With
    ``BLOCK_LOOPS`` (the fused backward's default since stop 34) each block is its own
    pipelined loop: offline, the backward's spills fall from 1,332 to 304 B (DeepSeek-V3
    one-rank view) and 256-column dx and SwiGLU-backward tiles compile beside it, every wgmma
    loop keeping one in flight. At 256 experts (two row steps a block) the weight gradients
    then took 16% longer on an H100, which those wider tiles made up. Reducing a strip of few
    rows as one dot a block over every row instead (zero-padded, the loop over blocks two
    stages deep, no accumulator carried) did not win that back (stop 35,
    benchmarks/FINDINGS.md). (The per-block reductions that once made ptxas serialize the
    kernel's wgmma, C7515, were laid out otherwise: two loops, one per gradient, into one
    accumulator zeroed before both.)

    The widths are run-time values, so that the backward's two weight gradients share one
    loop (one set of pipeline buffers in shared memory); ``ALIGNED`` says that both are
    multiples of 16 and the three pointers 16-byte aligned, which the asynchronous copies
    need to be proven.

    ``TMA`` (Hopper and later; needs 16-byte row strides and bases) reads both operands
    through tensor descriptors made here over exactly ``n_rows`` rows, so the copy engine
    zero-fills the step past the last row and the workers spend no registers or instructions
    on addresses and masks. On the H200 (``benchmarks/gemm_tiles.py``'s plain grid, DeepSeek-V3
    rank view, 128 x 128 blocks, 4 stages) that took dW[g;u] from about 400 to 560 TFLOP/s.
    A descriptor cannot have zero rows: ``n_rows == 0`` stores the zeros directly.
    ``TMA_STORE`` (with ``TMA``) also writes each finished block through a descriptor over
    ``out``: the copy engine takes the block from shared memory while the loop goes on.

    ``EVICT_FIRST`` stores the blocks (by pointer) with an L2 evict-first policy, so that they
    push out less of what the next blocks read (descriptor stores take no cache hint).

    ``PROFILE`` (with ``BLOCK_LOOPS``) adds to ``*epilogue_ns`` each block's time from the end
    of its loop to its store's issue.
    """
    if ALIGNED:
        M_DIM = tl.multiple_of(M_DIM, 16)
        N_DIM = tl.multiple_of(N_DIM, 16)
        a_ptr = tl.multiple_of(a_ptr, 16)
        b_ptr = tl.multiple_of(b_ptr, 16)
        out_ptr = tl.multiple_of(out_ptr, 16)
    steps = tl.maximum(tl.cdiv(n_rows, BK), 1)
    n_blocks = tl.minimum(tl.cdiv(N_DIM, BN) - blk0, STRIP)
    mcols = m0 + tl.arange(0, BM)
    m_ok = mcols < M_DIM
    zeros_only = False
    if TMA:
        zeros_only = n_rows == 0
    if zeros_only:
        for blk in range(blk0, blk0 + n_blocks):
            _store_block(out_ptr, mcols, m_ok, blk * BN + tl.arange(0, BN), N_DIM,
                         tl.zeros([BM, BN], dtype=tl.float32), EVICT_FIRST)
    else:
        a_desc = a_ptr
        b_desc = b_ptr
        o_desc = out_ptr
        if TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[n_rows, M_DIM], strides=[M_DIM, 1], block_shape=[BK, BM])
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[n_rows, N_DIM], strides=[N_DIM, 1], block_shape=[BK, BN])
            if TMA_STORE:
                o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M_DIM, N_DIM], strides=[N_DIM, 1],
                                                   block_shape=[BM, BN])
        if BLOCK_LOOPS:
            for blk in range(blk0, blk0 + n_blocks):
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for s in tl.range(0, steps, num_stages=STAGES):
                    a_op, b_op = _strip_operands(a_ptr, b_ptr, a_desc, b_desc, n_rows, m0, mcols, m_ok, s, blk,
                                                 M_DIM, N_DIM, BN, BK, DOT_DTYPE, TMA)
                    acc = tl.dot(a_op, b_op, acc)
                t_epilogue = now() if PROFILE else 0
                _strip_store(out_ptr, o_desc, m0, mcols, m_ok, blk, N_DIM, acc, BN, TMA and TMA_STORE, EVICT_FIRST)
                if PROFILE:
                    tl.atomic_add(epilogue_ns, now() - t_epilogue, sem="relaxed")
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.range(0, n_blocks * steps, num_stages=STAGES):
                blk = blk0 + i // steps
                s = i % steps
                a_op, b_op = _strip_operands(a_ptr, b_ptr, a_desc, b_desc, n_rows, m0, mcols, m_ok, s, blk,
                                             M_DIM, N_DIM, BN, BK, DOT_DTYPE, TMA)
                acc = tl.dot(a_op, b_op, acc)
                if s == steps - 1:
                    _strip_store(out_ptr, o_desc, m0, mcols, m_ok, blk, N_DIM, acc, BN, TMA and TMA_STORE, EVICT_FIRST)
                    acc = tl.zeros([BM, BN], dtype=tl.float32)
