"""In-kernel timing for profiling builds (GPU only: the interpreter has no inline assembly)."""

import triton
import triton.language as tl


@triton.jit
def now():
    """The GPU's global nanosecond timer, as int64."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)
