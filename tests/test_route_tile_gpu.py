"""The router's products on the GPU are as accurate as the reference's fp32 ones.

``kernels.route.router_logits`` takes bf16 tokens and a bf16 router weight as they are (one
16-bit dot, fp32 sums: the products of two bf16 values are exact in fp32), and an fp32 weight
through tf32x3. Either way the logits must be fp32 logits: measured against fp64, their error
stays within a small multiple of torch's fp32 ``F.linear`` on the same values (the reference
backend's router), or a routing choice near a tie could differ from the reference's.

The backward's router products (fp32 logit gradients times the bf16 router weight or tokens)
go through ``kernels.route.dot_fp32_bf16``, three bf16 dots of the fp32 operand's bf16 terms:
held to the same bound.
"""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.route import dot_fp32_bf16, router_logits

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


# DeepSeek-V3's and Qwen3-235B's router shapes (tokens no multiple of the 32-token tile).
@pytest.mark.parametrize("shape", [(7168, 256), (4096, 128), (7168, 32)], ids=["dsv3", "qwen3", "dsv3_rank"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_weight", "fp32_weight"])
def test_router_logits_are_fp32_accurate(shape, weight_dtype):
    H, E = shape
    T, BT = 1000, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=g) * H**-0.5).to(weight_dtype)
    out = torch.empty(T, E, device="cuda")
    _logits[(triton.cdiv(T, BT),)](x, w, out, T, H, E, BT, max(16, triton.next_power_of_2(E)), 64, "tf32x3",
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
    assert ours <= 4 * theirs + 1e-6, f"router tile error {ours:.3g} against fp32 F.linear's {theirs:.3g}"


@triton.jit
def _product(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, BK)
    acc = tl.zeros([M, N], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + ks)[None, :])
        b = tl.load(b_ptr + (k0 + ks)[:, None] * N + cols[None, :])
        acc = dot_fp32_bf16(a, b, acc, "tf32x3")
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


# The router-gradient tile (d logits^T x: 128 x 128, 4096 tokens deep) and the route-backward
# one (d logits @ W_router: 32 tokens x 64 columns, 256 experts deep).
@pytest.mark.parametrize("mnk", [(128, 128, 4096), (32, 64, 256)], ids=["router_grad", "route_backward"])
def test_fp32_by_bf16_products_are_fp32_accurate(mnk):
    M, N, K = mnk
    g = torch.Generator(device="cuda").manual_seed(0)
    # Logit gradients span many binades (softmax and top-k masks make many tiny or zero).
    a = torch.randn(M, K, device="cuda", generator=g) * 10.0 ** torch.randint(-6, 2, (M, K), device="cuda",
                                                                             generator=g)
    a[:, ::7] = 0.0
    b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(M, N, device="cuda")
    _product[(1,)](a, b, out, M, N, K, 64, num_warps=8)
    exact = a.double() @ b.double()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        reference = a @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    ours = (out.double() - exact).abs().max().item()
    theirs = (reference.double() - exact).abs().max().item()
    assert ours <= 4 * theirs + 1e-9, f"three-term bf16 product error {ours:.3g} against fp32 matmul's {theirs:.3g}"
