"""The router's products on the GPU keep tf32x3's accuracy with fewer dots.

The router needs fp32-accurate products, or a routing choice near a tie could differ from the
reference's fp32 router; on the GPU that is tf32x3 (three tf32 dots). Where an operand is bf16
(or fp16) its values are exact in tf32 and its low tf32 part is zero, so fewer dots give the
same sums: ``kernels.route.router_logits`` runs one tf32 dot on bf16 tokens and router
weight, ``kernels.route.dot_fp32_by_16bit`` two for fp32 logit gradients times bf16 tokens or
router weight. Each is held, on the same values, to within 1.5x of tf32x3's error against
fp64 (torch's fp32 matmul's error is printed beside them).

Measured on the H200 this way, bf16 dots are not good enough: one bf16 dot of the logits
erred 3.5e-5 where tf32x3 erred 2.1e-6 (DeepSeek-V3 shape), three bf16 dots of the logit
gradients' bf16 terms 1.2e-2 where tf32x3 erred 3.8e-4: the bf16 tensor cores' fp32 sums are
coarser than the tf32 ones.
"""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.route import dot_fp32_by_16bit, router_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the router tile's GPU precision needs a CUDA device"),
]


@triton.jit
def _logits(x_ptr, w_ptr, out_ptr, n_tokens, H: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
            BK: tl.constexpr, PRECISION: tl.constexpr):
    t0 = tl.program_id(0) * BT
    n_rows = tl.minimum(n_tokens - t0, BT)
    acc = router_logits(x_ptr + t0.to(tl.int64) * H, n_rows, w_ptr, H, E, BT, E_PAD, BK, PRECISION)
    rows, cols = tl.arange(0, BT), tl.arange(0, E_PAD)
    tl.store(out_ptr + (t0 + rows)[:, None] * E + cols[None, :], acc,
             mask=(rows < n_rows)[:, None] & (cols < E)[None, :])


def _fp32_error(fn, exact):
    """Largest |fn() - exact| with torch's fp32 matmuls kept off TF32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return (fn().double() - exact).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


# DeepSeek-V3's and Qwen3-235B's router shapes (tokens no multiple of the 32-token tile).
@pytest.mark.parametrize("shape", [(7168, 256), (4096, 128), (7168, 32)], ids=["dsv3", "qwen3", "dsv3_rank"])
def test_router_logits_accuracy(shape):
    H, E = shape
    T, BT = 1000, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    exact = x.double() @ w.double().T

    def tile(weight):
        out = torch.empty(T, E, device="cuda")
        _logits[(triton.cdiv(T, BT),)](x, weight, out, T, H, E, BT, max(16, triton.next_power_of_2(E)), 64, "tf32x3",
                                       num_warps=8)
        return out

    single = _fp32_error(lambda: tile(w), exact)          # bf16 operands: one tf32 dot
    tf32x3 = _fp32_error(lambda: tile(w.float()), exact)  # the same values through tf32x3
    fp32 = _fp32_error(lambda: torch.nn.functional.linear(x.float(), w.float()), exact)
    print(f"logits error against fp64: one tf32 dot {single:.3g}, tf32x3 {tf32x3:.3g}, torch fp32 {fp32:.3g}")
    assert single <= 1.5 * tf32x3 + 1e-7, (single, tf32x3, fp32)


@triton.jit
def _product(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, BK)
    acc = tl.zeros([M, N], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + ks)[None, :])
        b = tl.load(b_ptr + (k0 + ks)[:, None] * N + cols[None, :])
        acc = dot_fp32_by_16bit(a, b, acc, "tf32x3")
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


# The router-gradient tile (d logits^T x: 128 x 128, 4096 tokens deep) and the route-backward
# one (d logits @ W_router: 32 tokens x 64 columns, 256 experts deep).
@pytest.mark.parametrize("mnk", [(128, 128, 4096), (32, 64, 256)], ids=["router_grad", "route_backward"])
def test_fp32_by_bf16_products_accuracy(mnk):
    M, N, K = mnk
    g = torch.Generator(device="cuda").manual_seed(0)
    # Logit gradients span many binades (softmax and top-k masks make many tiny or zero).
    a = torch.randn(M, K, device="cuda", generator=g) * 10.0 ** torch.randint(-6, 2, (M, K), device="cuda",
                                                                             generator=g)
    a[:, ::7] = 0.0
    b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    exact = a.double() @ b.double()

    def tile(other):
        out = torch.empty(M, N, device="cuda")
        _product[(1,)](a, other, out, M, N, K, 64, num_warps=8)
        return out

    split = _fp32_error(lambda: tile(b), exact)            # two tf32 dots
    tf32x3 = _fp32_error(lambda: tile(b.float()), exact)   # the same values through tf32x3
    fp32 = _fp32_error(lambda: a @ b.float(), exact)
    print(f"product error against fp64: two tf32 dots {split:.3g}, tf32x3 {tf32x3:.3g}, torch fp32 {fp32:.3g}")
    assert split <= 1.5 * tf32x3 + 1e-9, (split, tf32x3, fp32)
