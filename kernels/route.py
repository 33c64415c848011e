"""Router tile: fp32 logits, scoring and top-k for a block of tokens.

Matches kosmos_moe.router exactly (same rules, same order of choices): softmax top-k with
optional renormalisation, or DeepSeek-V3's sigmoid scores with a bias-corrected,
group-limited choice and unbiased, renormalised, scaled weights.
"""

import triton
import triton.language as tl


@triton.jit
def _tf32_round(v):
    """``v`` rounded to tf32 (to nearest, ties away), as tf32x3 splits its operands."""
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _opaque_zeros(like):
    """Zeros shaped as ``like`` that the compiler cannot see are zero. Triton folds
    ``dot(a, b, 0) + acc`` into ``dot(a, b, acc)``; a dot started from these is not folded."""
    return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [like], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def router_dot(a, b, acc, PRECISION: tl.constexpr, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    """``acc + a @ b`` for fp32 ``a``, ``b``: ``tl.dot(a, b, acc, input_precision=PRECISION)``,
    in two tensor-core products instead of three where one operand is exact in tf32.

    tf32x3 sums three tf32 products of the operands' high and low tf32 parts, low ones first,
    into a fresh accumulator (a NaN among the low products is dropped), then adds that to
    ``acc`` in fp32. The fresh accumulator is what makes it accurate: one tf32 dot of bf16
    values, exact in tf32, runs the whole sum in the tensor cores' accumulator and erred 30x
    more (tests/test_route_tile_gpu.py). An operand that came from a 16-bit float (``A_EXACT``
    or ``B_EXACT``: bf16 tokens, a bf16 router weight) has a zero low part, so the product with
    the other's high part is zero; this runs the other two, in tf32x3's order, into a fresh
    accumulator. Where the exact operand is infinite, tf32x3's low part of it is NaN and this
    one's zero. Both exact: ``router_logits``.
    """
    if PRECISION == "tf32x3" and (A_EXACT != B_EXACT):
        if B_EXACT:
            a_hi = _tf32_round(a)
            low = tl.dot(a - a_hi, b, input_precision="tf32")
            out = acc + tl.dot(a_hi, b, tl.where(low != low, 0.0, low), input_precision="tf32")
        else:
            b_hi = _tf32_round(b)
            low = tl.dot(a, b - b_hi, input_precision="tf32")
            out = acc + tl.dot(a, b_hi, tl.where(low != low, 0.0, low), input_precision="tf32")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _tokens(x_ptr, rows, row_ok, k, H: tl.constexpr):
    """``x[rows, k]`` in fp32 (zero outside)."""
    return tl.load(x_ptr + rows.to(tl.int64)[:, None] * H + k[None, :], mask=row_ok[:, None] & (k < H)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _weight_t(w_ptr, cols, col_ok, k, H: tl.constexpr):
    """``W[cols, k]^T`` in fp32 (zero outside)."""
    return tl.load(w_ptr + cols[None, :] * H + k[:, None], mask=(k < H)[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def router_logits(
    x_ptr, n_rows, w_ptr,
    H: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr, BK: tl.constexpr,
    STAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    """fp32 ``x[:BT] @ W^T`` for ``W`` ``[E, H]``; padded rows and columns are zero.

    A step is ``BT x E_PAD x BK``, a few KB of operands at a few dozen experts, so the loop is
    bound by the copies' latency unless several are in flight (``STAGES - 1`` of them).

    With tf32x3 and both operands from 16-bit floats (bf16 tokens and router weight), their
    low tf32 parts are zero and a step is its high product alone: run into a fresh accumulator
    and added in fp32, as tf32x3 does (``router_dot``), with a third of its tensor-core work.
    It is as accurate as tf32x3 (tests/test_route_tile_gpu.py holds both to 3x torch's fp32
    error) but not the same to the bit (on an H100 some logits differed from tf32x3's on the
    same values; how many and by how much was not recorded).
    The product runs as two chained dots of half the depth, since a chain of dots is what
    makes Triton spread the warps over the tokens alone (layout [8, 1]: each warp holds whole
    rows of the logits, so the top-k's row reductions stay within a warp). As one dot it got
    [2, 4], and the kernel's register allocation moved spills into the down tiles' epilogue
    (offline sm_90, DeepSeek-V3 32 experts: 192 B against 12; those tiles took 1.3 us more
    each on the H100, stop 38).
    """
    rows = tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < n_rows
    col_ok = cols < E
    X_EXACT: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth == 16
    W_EXACT: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth == 16
    acc = tl.zeros([BT, E_PAD], dtype=tl.float32)
    if PRECISION == "tf32x3" and X_EXACT and W_EXACT:
        HALF: tl.constexpr = BK // 2
        ks = tl.arange(0, HALF)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            step = tl.dot(_tokens(x_ptr, rows, row_ok, k0 + ks, H), _weight_t(w_ptr, cols, col_ok, k0 + ks, H),
                          _opaque_zeros(acc), input_precision="tf32")
            step = tl.dot(_tokens(x_ptr, rows, row_ok, k0 + HALF + ks, H),
                          _weight_t(w_ptr, cols, col_ok, k0 + HALF + ks, H), step, input_precision="tf32")
            acc += step
    else:
        ks = tl.arange(0, BK)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = _tokens(x_ptr, rows, row_ok, k0 + ks, H)
            acc = router_dot(a, _weight_t(w_ptr, cols, col_ok, k0 + ks, H), acc, PRECISION, X_EXACT, W_EXACT)
    return acc


@triton.jit
def top_k_routing(
    logits, bias_ptr, scale,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
    SIGMOID_GROUP: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr,
    K_PAD: tl.constexpr, NORM_TOPK: tl.constexpr,
):
    """Return ``(experts, weights)``, ``[BT, K_PAD]`` int32 global ids and fp32 weights.

    Columns past ``TOP_K`` are zero. Implemented as ``TOP_K`` rounds of arg-max so the choices come out in descending order, as
    ``torch.topk`` gives them.
    """
    cols = tl.arange(0, E_PAD)
    col_ok = (cols < E)[None, :]
    neg_inf = float("-inf")
    if SIGMOID_GROUP:
        scores = tl.sigmoid(logits)
        bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
        choice = tl.where(col_ok, scores + bias[None, :], neg_inf)
        if N_GROUP > 1:
            GROUP_SIZE: tl.constexpr = E // N_GROUP
            groups = tl.arange(0, G_PAD)
            group_of_col = cols // GROUP_SIZE
            group_score = tl.full([logits.shape[0], G_PAD], neg_inf, tl.float32)
            for g in tl.static_range(N_GROUP):
                in_group = (group_of_col == g)[None, :]
                masked = tl.where(in_group, choice, neg_inf)
                first = tl.argmax(masked, axis=1, tie_break_left=True)
                top1 = tl.max(masked, axis=1)
                score_g = top1
                if GROUP_SIZE > 1:
                    second = tl.max(tl.where(cols[None, :] == first[:, None], neg_inf, masked), axis=1)
                    score_g = top1 + second
                group_score = tl.where((groups == g)[None, :], score_g[:, None], group_score)
            keep_col = tl.zeros([logits.shape[0], E_PAD], dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                g_best = tl.argmax(group_score, axis=1, tie_break_left=True)
                group_score = tl.where(groups[None, :] == g_best[:, None], neg_inf, group_score)
                keep_col = keep_col | (group_of_col[None, :] == g_best[:, None])
            choice = tl.where(keep_col, choice, neg_inf)
    else:
        shifted = tl.where(col_ok, logits, neg_inf)
        shifted = shifted - tl.max(shifted, axis=1)[:, None]
        numer = tl.exp(shifted)
        scores = numer / tl.sum(numer, axis=1)[:, None]
        choice = tl.where(col_ok, scores, neg_inf)

    kcols = tl.arange(0, K_PAD)[None, :]
    experts = tl.zeros([logits.shape[0], K_PAD], dtype=tl.int32)
    weights = tl.zeros([logits.shape[0], K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1, tie_break_left=True)
        hit = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        choice = tl.where(hit, neg_inf, choice)
        experts = tl.where(kcols == i, best.to(tl.int32)[:, None], experts)
        weights = tl.where(kcols == i, w[:, None], weights)
    total = tl.sum(weights, axis=1)[:, None]
    if SIGMOID_GROUP:
        if NORM_TOPK:
            weights = weights / (total + 1e-20)
        weights = weights * scale
    elif NORM_TOPK:
        weights = weights / total
    return experts, weights


@triton.jit
def routing_backward(
    logits, experts, weights, d_weights, scale,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    SIGMOID_GROUP: tl.constexpr, NORM_TOPK: tl.constexpr,
):
    """``[BT, E_PAD]`` fp32 gradient of the logits from that of the routing weights.

    ``experts``/``weights``/``d_weights`` are ``[BT, K_PAD]`` (the forward's choice and
    weights, and ``<grad_out, y_k>``). The choice itself carries no gradient, as in
    kosmos_moe.router; only the gathered scores do.
    """
    cols = tl.arange(0, E_PAD)
    col_ok = (cols < E)[None, :]
    kcols = tl.arange(0, K_PAD)[None, :]
    k_ok = kcols < TOP_K
    if SIGMOID_GROUP:
        scores = tl.sigmoid(logits)
    else:
        shifted = tl.where(col_ok, logits, float("-inf"))
        shifted = shifted - tl.max(shifted, axis=1)[:, None]
        numer = tl.exp(shifted)
        scores = numer / tl.sum(numer, axis=1)[:, None]
    # Each chosen expert's raw score r_k, then d r_k from d w_k through the renormalisation.
    raw = tl.zeros(weights.shape, dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        e_i = tl.sum(tl.where(kcols == i, experts, 0), axis=1)
        r_i = tl.sum(tl.where(cols[None, :] == e_i[:, None], scores, 0.0), axis=1)
        raw = tl.where(kcols == i, r_i[:, None], raw)
    dw = tl.where(k_ok, d_weights, 0.0)
    if SIGMOID_GROUP:
        if NORM_TOPK:
            # w_k = scale * r_k / (R + eps): d r_k = (scale * d w_k - <d w, w>) / (R + eps)
            denom = tl.sum(raw, axis=1)[:, None] + 1e-20
            d_raw = (scale * dw - tl.sum(dw * weights, axis=1)[:, None]) / denom
        else:
            d_raw = scale * dw
    else:
        if NORM_TOPK:
            # w_k = r_k / R: d r_k = (d w_k - <d w, w>) / R
            denom = tl.sum(raw, axis=1)[:, None]
            d_raw = (dw - tl.sum(dw * weights, axis=1)[:, None]) / denom
        else:
            d_raw = dw
    d_raw = tl.where(k_ok, d_raw, 0.0)
    # Scatter back to expert columns (a token picks an expert at most once).
    d_scores = tl.zeros(logits.shape, dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        e_i = tl.sum(tl.where(kcols == i, experts, 0), axis=1)
        d_i = tl.sum(tl.where(kcols == i, d_raw, 0.0), axis=1)
        d_scores = tl.where(cols[None, :] == e_i[:, None], d_i[:, None], d_scores)
    if SIGMOID_GROUP:
        d_logits = d_scores * scores * (1.0 - scores)
    else:
        d_logits = scores * (d_scores - tl.sum(d_scores * scores, axis=1)[:, None])
    return tl.where(col_ok, d_logits, 0.0)
