"""Signals between workers and ranks: typed peer pointers, release/acquire, error records.

Protocol (DESIGN.md invariant 3): a producer stores its data from every thread, then
``tl.debug_barrier()``, then one release atomic on the signal. A consumer polls with acquire
atomics, then ``tl.debug_barrier()``, then loads. The barrier after the poll makes the acquire
observed by the polling threads order the loads of every thread of the program.

Only ``tl.atomic_*`` are used, so the interpreter runs the same code as the GPU. The one
exception is ``async_proxy_fence``, for a consumer that reads by TMA: the launcher compiles it
in on the GPU only.
"""

import triton
import triton.language as tl

# Error kinds written to the error record; decoded by kosmos_moe.fused.
ERR_COUNTS = tl.constexpr(1)      # waited for the count-exchange signal of a peer
ERR_ROUTE = tl.constexpr(2)       # waited for this rank's own route tiles
ERR_ROWS = tl.constexpr(3)        # waited for dispatched rows of a local expert
ERR_GATE_UP = tl.constexpr(4)     # waited for the gate/up tiles of a row tile
ERR_COMBINE = tl.constexpr(5)     # waited for combined results of a local token
ERR_SHARED = tl.constexpr(6)      # waited for the shared expert's gate/up tiles
ERR_LAYOUT = tl.constexpr(7)      # backward: waited for this rank's own layout / send-list tiles
ERR_DH_TILE = tl.constexpr(8)     # backward: waited for the SwiGLU-backward tiles of a row tile
ERR_DW = tl.constexpr(9)          # backward: waited for routing-weight gradients of a local token
ERR_DH_EXPERT = tl.constexpr(10)  # backward: waited for the SwiGLU-backward tiles of an expert
ERR_SHORT = tl.constexpr(11)      # combine: given fewer expert outputs than rows were dispatched


# Every fabric hands out workspaces aligned to this many bytes (allocator blocks, symmetric
# memory, page-aligned mappings); telling the compiler so is what lets loads and stores of
# workspace rows vectorise (without it, every bf16 element moves on its own).
WORKSPACE_ALIGN = tl.constexpr(256)


@triton.jit
def peer_base(peers_ptr, rank):
    """``rank``'s workspace base address as int64 (scalar ``rank``), known aligned."""
    return tl.multiple_of(tl.load(peers_ptr + rank), WORKSPACE_ALIGN)


@triton.jit
def row_bases(peers_ptr, ranks, W: tl.constexpr):
    """Per row, the workspace base (int64, known aligned) of its rank ``ranks`` (a vector of
    ranks below ``W``).

    The ``W`` bases are loaded once, with no dependence on the rows, and each row takes its
    own from registers (``tl.gather``): a load of ``peers_ptr + ranks`` per row waits for the
    load of the rank itself first, and in the forward's down epilogue those two dependent
    loads came once for each of the 16 row chunks a thread stores (Nsight Compute on the H200,
    DeepSeek-V3 32 experts: about 2.6% of the kernel's stall samples waiting on them,
    benchmarks/stall_profile.py). A chain of ``W - 1`` selects instead cost registers at
    ``W = 8`` (offline sm_90, DeepSeek-V3 256 experts over 8 ranks: forward spills 236 B,
    against 72 with the per-row loads and 44 with the gather).
    """
    if W == 1:  # every row's rank is 0: its one base, broadcast
        base = tl.zeros_like(ranks).to(tl.int64) + tl.load(peers_ptr)
    else:
        W_PAD: tl.constexpr = triton.next_power_of_2(W)
        w_idx = tl.arange(0, W_PAD)
        bases = tl.load(peers_ptr + w_idx, mask=w_idx < W, other=0)
        base = tl.gather(bases, ranks, 0)
    return tl.multiple_of(base, WORKSPACE_ALIGN)


@triton.jit
def peer_ptr(peers_ptr, rank, byte_offset, DTYPE: tl.constexpr):
    """Typed pointer ``byte_offset`` bytes into ``rank``'s workspace (scalar rank).

    The alignment hint goes on the typed base pointer and the offset is added in elements, so
    that the compiler keeps the hint (an offset folded into the integer would drop it).
    ``byte_offset`` is meant to be a ``tl.constexpr`` (a ``B_*`` or ``C_*`` offset): past 2**31
    Triton widens a constant, while a runtime int32 offset would wrap.
    """
    ELEM: tl.constexpr = DTYPE.primitive_bitwidth // 8
    base = tl.multiple_of(peer_base(peers_ptr, rank).to(tl.pointer_type(DTYPE)), WORKSPACE_ALIGN)
    return base + byte_offset // ELEM


@triton.jit
def async_proxy_fence():
    """After a consumer's acquire and barrier, before its TMA reads of data other workers or
    ranks stored: the acquire orders the generic proxy only, and the copy engine reads through
    the async proxy (PTX: ``fence.proxy.async`` orders the two for the executing thread)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def signal_add(ptr, value, SCOPE: tl.constexpr):
    """Publish the data every thread stored before this call, then add ``value`` to the signal."""
    tl.debug_barrier()
    tl.atomic_add(ptr, value, sem="release", scope=SCOPE)


@triton.jit
def record_error(err_ptr, abort_ptr, kind, rank, task, peer, index, expected, observed):
    """Keep the first timeout of this rank and tell every worker to stop."""
    if tl.atomic_cas(err_ptr, 0, kind, sem="relaxed") == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, task)
        tl.store(err_ptr + 3, peer)
        tl.store(err_ptr + 4, index)
        tl.store(err_ptr + 5, expected)
        tl.store(err_ptr + 6, observed)
    tl.atomic_xchg(abort_ptr, 1, sem="release", scope="gpu")
