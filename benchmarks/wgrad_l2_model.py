"""An LRU model of the L2 misses of the fused backward's weight-gradient tasks, by strip length.

Each weight-gradient task reduces ``BackwardTiles.wgrad_strip`` consecutive 128 x 256 blocks
of one expert's gradient over the expert's rows, one pipelined loop per block
(``tile_gemm.row_reduction_strip``), so it reads its own 128-column row block of one operand
again for every block it makes. Many tasks run at once, one per worker; the more blocks per
task, the more distinct row blocks are in use at once. This model replays the tasks' reads in
the kernel's ticket order (dW[g;u] tasks, expert by expert, row block by row block, strips
fastest, then the dWd tasks), 132 workers taking the next ticket as they finish, each 64-row
step of a block reading its two operand chunks at a fixed step time, through an LRU cache of
the given size, and counts the misses as DRAM reads. It leaves out everything else the
backward runs at the same time (dx and SwiGLU-backward tiles, which only add pressure), the
blocks' stores (evict-first in the kernel) and L2's two partitions (which is why 25 MB, half
of the H100's and H200's 50 MB, is modelled beside the whole)::

    python benchmarks/wgrad_l2_model.py --cases dsv3_rank qwen3_rank --strips 16 8 4

Stop 49's Nsight Compute counters put the DeepSeek-V3 32-expert backward's DRAM reads at
16.5 GB against 5.1 GB for each buffer read once. The model said 16 -> 4 blocks a task would
save 7.3 GB there; on an H100 (stop 50) the backward's DRAM reads fell by 4.6 GB (16.1 to
11.5) and its time did not move, so the model bounds bytes, not time. benchmarks/FINDINGS.md
has both.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random

from layer_forward import ONE_RANK_CASES, TOKENS, case_config

WORKERS = 132
BWM, BWN, BKW = 128, 256, 64  # BackwardTiles.wgrad_rows, wgrad_cols, wgrad_depth


def tickets(counts: list[int], H: int, I: int, strip: int) -> list[tuple[int, list[tuple]]]:
    """The weight-gradient tickets in claim order: (expert, [(a row block, b column block), ...])."""
    out = []
    # dW[g;u] = [dg du]^T x: a = [dg du] rows (2I columns), b = x rows (H); then dWd = g^T (w h).
    for a_name, m_dim, b_name, n_dim in (("dgu", 2 * I, "x", H), ("g", H, "hw", I)):
        n_blocks = math.ceil(n_dim / BWN)
        for e in range(len(counts)):
            for mb in range(math.ceil(m_dim / BWM)):
                for s0 in range(0, n_blocks, strip):
                    out.append((e, [((a_name, mb), (b_name, nb)) for nb in range(s0, min(s0 + strip, n_blocks))]))
    return out


def dram_reads(case: str, strip: int, cache_mb: float, step_us: float = 0.97, block_us: float = 4.5,
               seed: int = 0) -> dict[str, float]:
    """Bytes the weight-gradient tasks read from L2, the LRU misses, and each operand read once."""
    c = case_config(case)
    H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
    rng = random.Random(seed)
    counts = [0] * E
    for _ in range(TOKENS):
        for e in rng.sample(range(E), c.top_k):
            counts[e] += 1
    free = [(0.0, w) for w in range(WORKERS)]
    heapq.heapify(free)
    reads = []
    for e, blocks in tickets(counts, H, I, strip):
        now, w = heapq.heappop(free)
        steps = max(1, math.ceil(counts[e] / BKW))
        for a, b in blocks:
            for s in range(steps):
                reads.append((now + s * step_us, (e, *a, s), BKW * BWM * 2))
                reads.append((now + s * step_us, (e, *b, s), BKW * BWN * 2))
            now += steps * step_us + block_us
        heapq.heappush(free, (now, w))
    reads.sort(key=lambda r: r[0])
    cache, used, total, missed = collections.OrderedDict(), 0, 0, 0
    for _, key, nbytes in reads:
        total += nbytes
        if key in cache:
            cache.move_to_end(key)
            continue
        missed += nbytes
        cache[key] = nbytes
        used += nbytes
        while used > cache_mb * 2**20:
            used -= cache.popitem(last=False)[1]
    once = sum(2 * c * (2 * I + H + H + I) for c in counts)
    return {"l2_reads": total, "dram_reads": missed, "once": once}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=ONE_RANK_CASES, default=["dsv3_rank", "qwen3_rank"])
    parser.add_argument("--strips", nargs="+", type=int, default=[16, 8, 4], help="blocks per task")
    parser.add_argument("--cache-mb", nargs="+", type=float, default=[25, 50])
    args = parser.parse_args()
    for case in args.cases:
        for cache_mb in args.cache_mb:
            for strip in args.strips:
                r = dram_reads(case, strip, cache_mb)
                print(f"{case:10s} {cache_mb:4.0f} MB cache, {strip:2d} blocks a task: "
                      f"L2 reads {r['l2_reads'] / 1e9:5.1f} GB, DRAM reads {r['dram_reads'] / 1e9:5.2f} GB "
                      f"(each operand once: {r['once'] / 1e9:.2f})", flush=True)


if __name__ == "__main__":
    main()
