"""The router tile's logits on the GPU are as accurate as the reference's fp32 ones.

A routing choice near a tie follows the logits' last bits, so ``kernels.route.router_logits``
must give fp32-accurate logits like the reference backend's fp32 ``F.linear``: on the GPU it
runs tf32x3 dots (three tf32 dots of the operands' high and low tf32 parts). Measured against
fp64 on the same values, its error must stay within 3x torch's fp32 error (tf32x3 measured
1.1-2.2x on the H200).

This test stopped two shortcuts on the H200 (DeepSeek-V3 router shape, bf16 tokens and
weight, largest error against fp64): one bf16 dot 3.5e-5 and one tf32 dot 6.8e-5, where
tf32x3 gives 2.1e-6 and torch's fp32 matmul 1.8e-6. Both look exact, as bf16 values are exact
in tf32 and their products exact in fp32; the likely cause is the tensor cores' running sums,
coarser than fp32 adds (not checked further).
"""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.route import router_logits

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
    assert ours <= 3 * theirs + 1e-7, f"router tile error {ours:.3g} against fp32 F.linear's {theirs:.3g}"
