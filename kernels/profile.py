"""In-kernel timing for profiling builds (GPU only: the interpreter has no inline assembly)."""

import triton
import triton.language as tl


@triton.jit
def now():
    """The GPU's global nanosecond timer, as int64."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


# After the 16 per-kind nanosecond slots and the 16 pass counts: each worker's [start, exit]
# timestamps of the last profiled call, two int64 slots a worker. How far apart the workers
# leave is how much of the launch's end runs on fewer than all SMs.
SPANS_AT = 32  # host side: kosmos_moe.fused sizes and reads the buffer by it
PROFILE_SPANS = tl.constexpr(SPANS_AT)


@triton.jit
def record_worker_span(profile_ptr, t_start):
    """Store this worker's start (``t_start``) and exit (now) in its two span slots."""
    slot = profile_ptr + PROFILE_SPANS + 2 * tl.program_id(0)
    tl.store(slot, t_start)
    tl.store(slot + 1, now())
