"""The router tile's logits on the GPU are as accurate as the reference's fp32 ones.

A routing choice near a tie follows the logits' last bits, so ``kernels.route.router_logits``
must give fp32-accurate logits like the reference backend's fp32 ``F.linear``: on the GPU it
runs tf32x3 dots (three tf32 dots of the operands' high and low tf32 parts, into a fresh
accumulator a step; where an operand came from a 16-bit float its low part is zero, and only
the other products run: ``route.router_dot``, which must give tf32x3's bits, and the route
tile's one product a step when both operands are bf16). Measured against fp64 on the same
values, its error must stay within 3x torch's fp32 error (tf32x3 measured 1.1-2.2x on the
H200).

This test stopped two shortcuts on the H200 (DeepSeek-V3 router shape, bf16 tokens and
weight, largest error against fp64): one bf16 dot 3.5e-5 and one tf32 dot 6.8e-5, where
tf32x3 gives 2.1e-6 and torch's fp32 matmul 1.8e-6. Both look exact, as bf16 values are exact
in tf32 and their products exact in fp32; what they lack is tf32x3's fresh accumulator each
step. On an H100 at stop 38, one tf32 product a step added to the running sum in fp32 erred
6.8e-5 too: Triton had folded ``acc + dot(a, b, 0)`` back into ``dot(a, b, acc)``; started
from zeros it cannot fold (``route._opaque_zeros``) it passes.
"""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.route import router_dot, router_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the router tile's GPU precision needs a CUDA device"),
]


@triton.jit
def _logits(x_ptr, w_ptr, out_ptr, n_tokens, H: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
            BK: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    t0 = tl.program_id(0) * BT
    n_rows = tl.minimum(n_tokens - t0, BT)
    acc = router_logits(x_ptr + t0.to(tl.int64) * H, n_rows, w_ptr, H, E, BT, E_PAD, BK, STAGES, PRECISION)
    rows, cols = tl.arange(0, BT), tl.arange(0, E_PAD)
    tl.store(out_ptr + (t0 + rows)[:, None] * E + cols[None, :], acc,
             mask=(rows < n_rows)[:, None] & (cols < E)[None, :])


# DeepSeek-V3's and Qwen3-235B's router shapes (tokens no multiple of the 32-token tile), with
# the router weight in the activation dtype and in fp32.
@pytest.mark.parametrize("shape", [(7168, 256), (4096, 128), (7168, 32)], ids=["dsv3", "qwen3", "dsv3_rank"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_weight", "fp32_weight"])
def test_router_logits_are_fp32_accurate(shape, weight_dtype):
    H, E = shape
    T, BT = 1000, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=g) * H**-0.5).to(weight_dtype)
    out = torch.empty(T, E, device="cuda")
    _logits[(triton.cdiv(T, BT),)](x, w, out, T, H, E, BT, max(16, triton.next_power_of_2(E)), 64, 4, "tf32x3",
                                   num_warps=8)
    exact = x.double() @ w.double().T
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        reference = torch.nn.functional.linear(x.float(), w.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    ours = (out.double() - exact).abs().max().item()
    theirs = (reference.double() - exact).abs().max().item()
    # fp32 sums of 4096-7168 terms in another order: the same size of error, not the same error.
    assert ours <= 3 * theirs + 1e-7, f"router tile error {ours:.3g} against fp32 F.linear's {theirs:.3g}"


@triton.jit
def _dots(a_ptr, b_ptr, c_ptr, ours_ptr, theirs_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
          A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    c = tl.load(c_ptr + m[:, None] * N + n[None, :])
    at = m[:, None] * N + n[None, :]
    tl.store(ours_ptr + at, router_dot(a, b, c, "tf32x3", A_EXACT, B_EXACT))
    tl.store(theirs_ptr + at, tl.dot(a, b, c, input_precision="tf32x3"))


# The route backward's steps (fp32 logit gradients times the bf16 router weight) and the
# router weight gradient's (the transposed logit gradients times bf16 tokens), and the other
# operand exact.
@pytest.mark.parametrize("exact", [(False, True), (True, False)], ids=["b_exact", "a_exact"])
@pytest.mark.parametrize("shape", [(32, 64, 64), (128, 128, 32)], ids=["route_backward", "router_grad"])
def test_router_dot_gives_tf32x3_bits(exact, shape):
    M, N, K = shape
    g = torch.Generator(device="cuda").manual_seed(1)

    def operand(rows, cols, is_exact):
        v = torch.randn(rows, cols, device="cuda", generator=g) * 3.0
        return v.to(torch.bfloat16).float() if is_exact else v

    a, b = operand(M, K, exact[0]), operand(K, N, exact[1])
    c = torch.randn(M, N, device="cuda", generator=g)
    ours, theirs = torch.empty_like(c), torch.empty_like(c)
    _dots[(1,)](a, b, c, ours, theirs, M, N, K, exact[0], exact[1], num_warps=8)
    assert torch.equal(ours, theirs), f"{(ours != theirs).sum().item()} of {ours.numel()} values differ from tf32x3's"

