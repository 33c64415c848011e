"""Queue arithmetic shared by the persistent kernels: task lookup in prefix sums, count tables."""

import triton
import triton.language as tl


@triton.jit
def pick(vec, idx, i):
    """``vec[i]`` of a vector indexed by ``idx`` (a scalar out of a register vector)."""
    return tl.sum(tl.where(idx == i, vec, 0), axis=0)


@triton.jit
def locate(cum, idx, task):
    """For an inclusive prefix sum ``cum``: the bucket holding ``task`` and its first task."""
    bucket = tl.sum((cum <= task).to(tl.int32), axis=0)
    start = tl.sum(tl.where(idx == bucket - 1, cum, 0), axis=0)
    return bucket, start


@triton.jit
def recv_table(ctl, par, me, W: tl.constexpr, W_PAD: tl.constexpr, E: tl.constexpr,
                E_L: tl.constexpr, EL_PAD: tl.constexpr, C_TABLE: tl.constexpr):
    """``[W_PAD, EL_PAD]``: rows each source sends to each of this rank's local experts."""
    src = tl.arange(0, W_PAD)[:, None]
    el = tl.arange(0, EL_PAD)[None, :]
    return tl.load(ctl + C_TABLE + par * W * E + src * E + me * E_L + el,
                   mask=(src < W) & (el < E_L), other=0)
