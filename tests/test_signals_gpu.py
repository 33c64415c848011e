"""Stress test of the signal protocol on the GPU: data stored before a release is seen after it.

Producers store a block from every thread, then ``signal_add`` (barrier + release atomic);
consumers on other SMs poll with acquire atomics, barrier, and check every element of the
block. Each round the producer overwrites the block only after the consumer's acknowledgement,
so any element a consumer sees out of date is a protocol failure.
"""

import pytest
import torch
import triton
import triton.language as tl

from kosmos_moe.kernels.signals import signal_add

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the signal stress test needs a CUDA device"),
]


@triton.jit
def _ping_pong(data, flags, acks, errors, PAIRS: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    if pid < PAIRS:
        for r in tl.range(0, ROUNDS):
            tl.store(data + pid * BLOCK + lane, r * BLOCK + lane)
            signal_add(flags + pid, 1, "gpu")
            seen = tl.atomic_add(acks + pid, 0, sem="acquire", scope="gpu")
            while seen != r + 1:
                seen = tl.atomic_add(acks + pid, 0, sem="acquire", scope="gpu")
    else:
        pair = pid - PAIRS
        bad = 0
        for r in tl.range(0, ROUNDS):
            seen = tl.atomic_add(flags + pair, 0, sem="acquire", scope="gpu")
            while seen != r + 1:
                seen = tl.atomic_add(flags + pair, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            got = tl.load(data + pair * BLOCK + lane)
            bad += tl.sum((got != r * BLOCK + lane).to(tl.int32), axis=0)
            signal_add(acks + pair, 1, "gpu")
        tl.store(errors + pair, bad)


def test_data_is_visible_after_each_flag():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pairs, rounds, block = sms // 2, 2000, 4096
    data = torch.zeros(pairs * block, dtype=torch.int32, device="cuda")
    flags = torch.zeros(pairs, dtype=torch.int32, device="cuda")
    acks = torch.zeros(pairs, dtype=torch.int32, device="cuda")
    errors = torch.full((pairs,), -1, dtype=torch.int32, device="cuda")
    _ping_pong[(2 * pairs,)](data, flags, acks, errors, PAIRS=pairs, ROUNDS=rounds, BLOCK=block, num_warps=8)
    torch.cuda.synchronize()
    assert torch.equal(flags, torch.full_like(flags, rounds))
    assert torch.equal(errors, torch.zeros_like(errors)), f"stale elements seen after a flag: {errors.tolist()}"
