"""Router tile: fp32 logits, scoring and top-k for a block of tokens.

Matches kosmos_moe.router exactly (same rules, same order of choices): softmax top-k with
optional renormalisation, or DeepSeek-V3's sigmoid scores with a bias-corrected,
group-limited choice and unbiased, renormalised, scaled weights.
"""

import triton
import triton.language as tl


@triton.jit
def router_logits(
    x_ptr, n_rows, w_ptr,
    H: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 ``x[:BT] @ W^T`` for ``W`` ``[E, H]``; padded rows and columns are zero."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    ks = tl.arange(0, BK)
    row_ok = rows < n_rows
    col_ok = cols < E
    acc = tl.zeros([BT, E_PAD], dtype=tl.float32)
    # fp32 operands and up to 256 expert columns: two stages keep shared memory in bounds.
    for k0 in tl.range(0, H, BK, num_stages=2):
        k_ok = (k0 + ks) < H
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * H + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(w_ptr + cols[None, :] * H + (k0 + ks)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
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
