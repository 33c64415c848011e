"""The worst-case workspaces of the fused forward and backward: layouts and sizes, fixed at build time.

Every rank holds one workspace of the same layout; peers reach into it through the fabric.
With ``T = max_tokens_per_rank``, ``W`` ranks, ``E`` experts (``L = E / W`` local), top-k ``K``,
hidden ``H``, expert width ``I`` and shared width ``I_s``:

* receive rows ``R = W * T * min(K, L)``: one row per (token, chosen expert) that lands on
  this rank. A token picks ``K`` distinct experts, at most ``min(K, L)`` of them local to one
  rank, and each of ``W`` sources sends at most ``T`` tokens, so no routing can overflow it;
* activation-dtype buffers: received rows ``R x H``, SwiGLU activations ``R x I`` and
  ``T x I_s``, and the combine buffer ``T x (K + shared) x H`` that experts write results into;
* int32 control words: queue heads, signals, count tables ``2 x W x E``, per-expert send lists
  ``E x T``, arrival counters and row metadata; fp32 routing weights.

For DeepSeek-V3 in bf16 at ``T = 4096`` on one rank the forward's is 1.07 GiB; at EP=8,
5.02 GiB per rank, dominated by ``R x H``: the price of never waiting on the host for the real
count (:func:`workspace_bytes`; the layers of a model can share them, kosmos_moe.sharing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from .config import MoEConfig

_ALIGN = 256

# Compile options every kernel launch passes, not left to Triton's defaults. FP fusion
# (``a * b + c`` as one FMA): Triton 3.9 warns that its default turns off in 3.10, and every
# timing and tolerance here was measured with it on.
PINNED_OPTIONS = {"enable_fp_fusion": True}
# Triton compile options among the kernels' launch keywords (the rest are tile constants).
COMPILE_OPTIONS = {"num_warps", *PINNED_OPTIONS}


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def check_tile_sizes(tiles) -> None:
    """Raise ``ValueError`` naming every bad size of a tiles dataclass: pipeline depths, strip
    lengths and workers per SM (fields ending in ``stages``, ``strip`` or ``per_sm``) must be
    positive, every other size (block shapes, which index ``tl.arange``, and warps) a power of
    two; Triton would otherwise fail deep inside the compile of the whole kernel. L2 promotions
    (fields ending in ``promotion``) must be one the driver encodes; thresholds (fields ending in
    ``_from``) must not be negative."""
    from .tma_promotion import PROMOTIONS

    bad = []
    for f in fields(tiles):
        v = getattr(tiles, f.name)
        if f.type not in (int, "int"):
            continue
        if f.name.endswith("promotion"):
            if v not in PROMOTIONS:
                bad.append(f"{f.name}={v} (L2 promotion bytes: one of {sorted(PROMOTIONS)})")
            continue
        if f.name.endswith("_from"):
            if v < 0:
                bad.append(f"{f.name}={v} (a threshold: not negative)")
            continue
        counts = f.name.endswith(("stages", "strip", "per_sm"))
        if v < 1 or (not counts and v & (v - 1)):
            bad.append(f"{f.name}={v}")
    if bad:
        kind = type(tiles).__name__
        raise ValueError(f"{kind}: depths, strips and workers per SM must be positive, block sizes and warps "
                         "powers of two: " + ", ".join(bad))


@dataclass(frozen=True, kw_only=True)
class Tiles:
    """Tile sizes of the fused forward (rows x columns of each task)."""

    # Route tiles of 32 tokens, 64 deep: twice the tiles of 64 tokens, so the route phase (when
    # little else is ready) is shorter, and no wgmma (M < 64), whose tf32x3 dots each waited
    # for. H200, benchmarks/layer_forward.py, one process, 64x32 -> 32x64: per-worker busy time
    # of qwen3_rank 2.44 -> 2.28 ms (nothing ready 0.13 -> 0.04). Its synchronised call time,
    # 3.01 -> 2.58 ms, also holds host time that varied by 0.2-0.4 ms between processes.
    route_tokens: int = 32       # BT: tokens per route tile
    route_depth: int = 64        # BK of the fp32 router GEMM
    # Pipeline stages of the router GEMM. A step is only 32 x E_PAD x 64 (8 KB of bf16 operands
    # at 32 experts, 36 KB at 256), so with 2 (one copy in flight, the default until stop 38)
    # each step waited out most of a copy's latency, while the route tiles hold up everything
    # else. H100 80GB, stop 38, layer_forward.py variant route_stages2, one run, forward device
    # ms 4 / 2 stages: DeepSeek-V3 32 experts 5.80 / 5.83, Qwen3 16 experts 2.20 / 2.25,
    # DeepSeek-V3 256 experts 10.93 / 11.01, Qwen3 128 experts 3.28 / 3.32.
    route_stages: int = 4
    dispatch_rows: int = 32      # BR: rows per dispatch chunk
    dispatch_cols: int = 512     # BH: columns per copy step
    rows: int = 128              # BM: rows per expert tile
    gate_up_cols: int = 128      # BN of the gate/up tiles: columns of gate and of up each
    down_cols: int = 256         # BN of the down tiles: 554 vs 440 TFLOP/s at 128 (benchmarks/gemm_tiles.py, H200)
    depth: int = 64              # BK
    fold_tokens: int = 16        # BTF
    fold_cols: int = 512         # BHF
    # Pipeline stages of the gate/up tiles (routed and shared) below ``many_experts_from``
    # local experts. 4 (variant stages4) gained only at Qwen3 128 experts and lost most at
    # DeepSeek-V3 256: H100 80GB, stop 40, gpu_session.sh variants-weights, one run, forward
    # device ms 3 / 4 stages: DeepSeek-V3 32 experts 5.63 / 5.65, Qwen3 16 2.15 / 2.18,
    # DeepSeek-V3 256 10.77 / 11.31, Qwen3 128 3.21 / 3.10 (the same split at stop 30; stop
    # 41, with 3 down stages: 11.02 / 11.15 and 3.19 / 3.06), all with the down tiles at 3
    # stages, their default then, and gate/up tickets claimed ahead.
    stages: int = 3
    # The same from ``many_experts_from`` local experts on, where an expert has few rows and its
    # weight blocks stream from HBM (at 4096 tokens and top-8, 256 rows an expert or fewer):
    # more weight bytes in flight per worker. H200, stop 51, gate/up tickets claimed on pass,
    # forward device ms 3 / 4 stages (layer_forward.py variant stages4, both orders in one
    # process each): DeepSeek-V3 256 experts 7.91 / 7.68 and 7.90 / 7.69, Qwen3 128 2.61 /
    # 2.54 and 2.61 / 2.53; the rank views within 0.5% either way (DeepSeek-V3 32 5.07 / 5.07
    # and 5.06 / 5.07, Qwen3 16 2.00 / 2.00 and 2.00 / 2.01). On the H100 4 stages lost 3-5% at
    # DeepSeek-V3 256 experts with tickets claimed ahead (above; stop 46 10.11 / 10.45); with
    # tickets claimed on pass (H100 80GB, stop 52, the same variants, default / 3 / 4 stages
    # everywhere, both orders) Qwen3 128 2.71 / 2.84 / 2.70 and 2.71 / 2.84 / 2.71, DeepSeek-V3
    # 256 9.43 / 9.49 / 9.42 and 9.44 / 9.50 / 9.41, DeepSeek-V3 32 5.18 / 5.17 / 5.30 and 5.17
    # / 5.17 / 5.31, Qwen3 16 2.04 / 2.03 / 2.07 and 2.04 / 2.03 / 2.07.
    many_experts_stages: int = 4
    many_experts_from: int = 128
    # Pipeline stages of the down tiles (routed and shared; 48 KB each at 128 x 256 x 64, so 4
    # take 192 KB). Their reduction is only I deep (32 steps at DeepSeek-V3), so a deeper
    # pipeline hides more of each tile's start. On their own (benchmarks/gemm_tiles.py, H200,
    # stop 39) the tiles ran at 597 against 562 TFLOP/s. In the kernel, forward device ms 3 / 4
    # stages (layer_forward.py variant down_stages4 then, down_stages3 now), H100 80GB, one run
    # at each of stops 30, 40 and 41: Qwen3 128 experts 3.38 / 3.30, 3.21 / 3.13, 3.19 / 3.12
    # (2.1-2.5% each time); DeepSeek-V3 32 experts 5.80 / 5.82, 5.63 / 5.58, 5.64 / 5.53;
    # Qwen3 16 2.31 / 2.31, 2.15 / 2.14, 2.14 / 2.15; DeepSeek-V3 256 11.46 / 11.38,
    # 10.77 / 10.84, 10.78 / 10.76. So 4 since stop 41 (3 before).
    down_stages: int = 4
    warps: int = 8
    # Workers per SM. With 2, two workers of 4 warps share each SM, each on its own task, so
    # one's tile start, epilogue and queue passes overlap the other's wgmma: what CUTLASS's
    # ping-pong schedule gets from two consumer warpgroups, without a producer warpgroup.
    # The compiled kernel must fit that many per SM (registers, shared memory); the launcher
    # checks before its first launch (kosmos_moe.residency). Slower on the H200 in every case
    # (layer_forward.py variant two_per_sm, 128 x 128 tiles: DeepSeek-V3 rank view 5.90 against
    # 5.48 ms, gate/up tiles 3.26 against 2.79 ms busy per worker; benchmarks/FINDINGS.md),
    # so 1.
    workers_per_sm: int = 1
    # Weight blocks by TMA where the device and strides allow it (kosmos_moe.fused.weight_descriptors).
    # Rows stay pointer loads: rows by TMA too (every row first copied expert-major) made no
    # forward faster, and the EP=1 ones 0-7% slower, on an H100 (stop 44, benchmarks/FINDINGS.md).
    tma: bool = True
    row_alignment_hint: bool = True  # tell the compiler gate/up rows are 16-byte aligned when they are (expert_forward)
    # Routed gate/up tiles as one dot of 2 x gate_up_cols columns, the gate block and the up
    # block side by side (tile_gemm.gate_up_pair_acc): the row block is read once per step, not
    # twice, and the loop issues half the wgmma (m64n256k16 against m64n128k16) and, by TMA, one
    # copy for both weight blocks (in the kernel, offline sm_90: 123 against 150 instructions per
    # step, same registers). H200, benchmarks/layer_forward.py, one run, two dots -> one: gate/up
    # busy per worker 3.18 -> 2.79 ms and the forward 5.72 -> 5.45 ms (DeepSeek-V3 rank view),
    # 1.29 -> 1.14 and 2.26 -> 2.15 ms (Qwen3 rank view).
    gate_up_one_dot: bool = True
    # Bytes the L2 cache fetches per TMA miss on the weight descriptors (kosmos_moe.tma_promotion).
    # Triton encodes 128, one k-step of a weight row (64 bf16 columns); 256 also brings the row's
    # next step into L2 ahead of its copy, where the weights stream from HBM (128 and 256
    # experts). H100 80GB, stop 45, layer_forward.py, forward device ms 128 / 256, one process
    # each: DeepSeek-V3 256 experts 10.91 / 10.24 and 10.36 / 10.26, Qwen3 128 3.06 / 3.00 and
    # 3.06 / 3.02; DeepSeek-V3 32 5.45 / 5.47, Qwen3 16 2.11 / 2.13 (variant weights_l2_128 runs
    # Triton's). Values other than 0, 64, 128 and 256 are refused here.
    weight_l2_promotion: int = 256
    # A dispatch chunk a worker took before every rank's counts were in runs first once they
    # are, ahead of any tile: every gate/up tile of its expert waits for it. Without this the
    # holder ran it only at its next pass that found nothing else ready, and a holder that
    # kept finding tiles ready could leave an expert's rows unannounced while every other
    # worker's GATE_UP ticket reached that expert. Stops 40 and 45 saw 1.7-3.8 ms idle per
    # worker holding GATE_UP tickets at DeepSeek-V3 256 experts with 4 gate/up stages; whether
    # held chunks caused it is not shown, since neither order idled at stop 46. H100 80GB,
    # stop 46, layer_forward.py variant held_chunk_later (the old order), one process, forward
    # device ms first / later: DeepSeek-V3 256 experts 10.11 / 10.15 (4 stages 10.45 / 10.65),
    # Qwen3 128 3.00 / 3.01 (2.96 / 2.99).
    held_chunk_first: bool = True
    # From this many local experts on, a routed tile finds its expert's rows, row tiles, first
    # row tile and first row in one reduction over the local experts (queues.locate_expert)
    # instead of four, so its lookups take two reductions instead of six. Over 128 or 256 local
    # experts each reduction crosses the warps (a shared-memory exchange and a barrier); over 32
    # the four picks are warp-local. Offline sm_90, stop 47, kernel with / without: at
    # DeepSeek-V3 256 experts 344 / 368 barrier instructions, spills 40 / 64 B, code 262,272 /
    # 264,704 B; at 32 experts 178 / 156 barriers and spills 56 / 0 B. H100 80GB, forward device
    # ms without / with (layer_forward.py variant merged_lookup, which sets 1; stop 48 one
    # process, stop 49 gpu_session.sh variants-lookup, both orders): DeepSeek-V3 256 experts
    # 10.17 / 9.99, 10.36 / 10.24, 10.39 / 10.28 (1.1-1.8% faster each time); DeepSeek-V3 32
    # experts 5.61 / 5.63, 5.49 / 5.67, 5.53 / 5.66; Qwen3 128 3.03 / 3.03, 3.07 / 3.11, 3.08 /
    # 3.09; Qwen3 16 2.17 / 2.19, 2.14 / 2.19, 2.16 / 2.16. So only at 256 and more.
    merged_lookup_from: int = 256
    # True: a worker starting a routed gate/up tile takes its next gate/up ticket at once, so
    # the claim's round trip overlaps the tile (the default from `d522b32` to stop 51; down
    # tiles still do so). The row tiles that share a gate/up weight block hold consecutive
    # tickets, but a held gate/up ticket waits behind every down tile its worker finds ready
    # (down comes first in a pass), so those tiles start further apart and the later ones find
    # the block gone from L2. False (the default since stop 51) claims a gate/up ticket only in
    # the pass that reaches that queue. H100 80GB, stop 51, forward device ms ahead / on pass
    # (layer_forward.py, gpu_session.sh variants-claim, two orders in one process each):
    # DeepSeek-V3 32 experts 5.66 / 5.23 and 5.64 / 5.23, 256 experts 10.28 / 9.77 and 10.28 /
    # 9.79, Qwen3 16 2.16 / 2.06 and 2.18 / 2.05, Qwen3 128 3.06 / 2.89 and 3.09 / 2.88. DRAM
    # read under Nsight Compute (stalls-claim): Qwen3 128 7.24 / 5.84 GB (5.24 for each buffer
    # once), DeepSeek-V3 32 5.90 GB on pass against 7.90-8.19 ahead (stops 49-50; 3.65 once).
    # Offline sm_90 the on-pass build's gate/up loop is 145 instructions a step against 123 at
    # DeepSeek-V3 32 experts (register allocation; same products, copies and barriers).
    gate_up_claim_ahead: bool = False

    def __post_init__(self) -> None:
        check_tile_sizes(self)

    def kernel_constants(self, local_experts: int) -> dict:
        """The forward kernel's tile constants for a rank of ``local_experts`` experts
        (the :data:`COMPILE_OPTIONS` included; ``TMA`` and the row alignment hint depend on the call
        and are the launcher's)."""
        gate_up_stages = self.many_experts_stages if local_experts >= self.many_experts_from else self.stages
        return dict(
            BT=self.route_tokens, BK_R=self.route_depth, R_STAGES=self.route_stages, BR=self.dispatch_rows,
            BH=self.dispatch_cols, BM=self.rows, BN_GU=self.gate_up_cols, BN_DN=self.down_cols, BK=self.depth,
            BTF=self.fold_tokens, BHF=self.fold_cols, STAGES=gate_up_stages, DN_STAGES=self.down_stages,
            GU_ONE_DOT=self.gate_up_one_dot, HELD_CHUNK_FIRST=self.held_chunk_first,
            MERGED_LOOKUP=local_experts >= self.merged_lookup_from, GU_CLAIM_AHEAD=self.gate_up_claim_ahead,
            num_warps=self.warps, **PINNED_OPTIONS,
        )


GPU_TILES = Tiles()
# The interpreter runs tl.dot in numpy: small tiles keep CPU tests quick (tl.dot needs >= 16).
# Tiles take keywords only: positional tiles once shifted by one field added to the class
# left the CPU forward on 1-token, 1-column fold blocks, 3 stages and 8 warps.
INTERPRETER_TILES = Tiles(
    route_tokens=16, route_depth=16, route_stages=1, dispatch_rows=16, dispatch_cols=32, rows=16, gate_up_cols=16,
    down_cols=16, depth=16, fold_tokens=16, fold_cols=32, stages=1, down_stages=1, warps=1,
)


@dataclass(frozen=True)
class WorkspaceLayout:
    """Word and byte offsets of every buffer in a rank's workspace, and its total size."""

    max_tokens: int
    world: int
    recv_rows: int
    tile_cap: int
    words: dict[str, int]
    bytes: dict[str, int]
    nbytes: int

    def key(self) -> tuple:
        """Equal for equal layouts (two launchers may share a workspace only then)."""
        return (self.max_tokens, self.world, self.recv_rows, self.tile_cap, tuple(self.words.items()),
                tuple(self.bytes.items()), self.nbytes)

    def kernel_args(self) -> dict[str, int]:
        args = {f"C_{k.upper()}": v for k, v in self.words.items()}
        args.update({f"B_{k.upper()}": v for k, v in self.bytes.items()})
        return args


def _pack(word_sizes: list[tuple[str, int]], byte_sizes: list[tuple[str, int]]):
    """int32 word indices after the fixed words, then aligned byte offsets; and the total bytes."""
    words, at = {}, FIXED_WORDS
    for name, n in word_sizes:
        words[name] = at
        at += n
    words["words"] = at
    offsets, pos = {}, _round_up(4 * at, _ALIGN)
    for name, n in byte_sizes:
        offsets[name] = pos
        pos = _round_up(pos + n, _ALIGN)
    return words, offsets, pos


FIXED_WORDS = 32  # epoch, exit, abort, route-done, queue heads, error record (kernels.expert_forward)


def forward_layout(
    config: MoEConfig, world: int, max_tokens: int, tiles: Tiles, dtype: torch.dtype
) -> WorkspaceLayout:
    """Lay out the workspace of one rank for ``max_tokens`` tokens per rank."""
    E, K, H = config.num_experts, config.top_k, config.hidden_size
    L = E // world
    I, I_s = config.moe_intermediate_size, config.shared_intermediate_size
    R = world * max_tokens * min(K, L)
    tile_cap = -(-R // tiles.rows) + L
    shared_tiles = -(-max_tokens // tiles.rows)
    slots = K + (1 if I_s > 0 else 0)

    # The reset at the end of a call clears send_cnt and [arrived, send_list) in one sweep,
    # so these keep their order.
    word_sizes = [
        ("send_cnt", E),
        ("table", 2 * world * E),
        ("flag", world),
        ("arrived", world * L),
        ("gu_done", tile_cap + shared_tiles),
        ("comb_arr", world * max_tokens),
        ("send_list", E * max_tokens),
        ("topk_e", max_tokens * K),
        ("recv_src", R),
        ("recv_ent", R),
    ]
    es = torch.tensor([], dtype=dtype).element_size()
    byte_sizes = [
        ("topk_w", 4 * max_tokens * K),
        ("recv_w", 4 * R),
        ("recv_x", es * R * H),
        ("h_r", es * R * I),
        ("h_s", es * max_tokens * max(I_s, 1)),
        ("comb", es * max_tokens * slots * H),
    ]
    words, offsets, pos = _pack(word_sizes, byte_sizes)
    if max(words.values()) >= 2**31 or R * max(H, I) >= 2**62:
        raise ValueError("workspace too large to index; lower max_tokens_per_rank")
    return WorkspaceLayout(max_tokens, world, R, tile_cap, words, offsets, pos)


@dataclass(frozen=True, kw_only=True)
class BackwardTiles:
    """Tile sizes of the fused backward."""

    route_tokens: int = 32       # BT: tokens per layout and route-backward tile (fp32 [BT, E] tiles: 32 keeps shared memory near 100 KB)
    route_depth: int = 64        # BK_R: experts per step of the route backward's d logits @ Wr
    # Its pipeline stages (fp32 operands: 24 KB a stage at 32 x 64 x 64). H100 80GB, stop 33,
    # DeepSeek-V3 256 experts: route backward 0.88 against 1.38 ms busy per worker with one.
    route_stages: int = 2
    route_cols: int = 64         # BHR: columns per step of d logits @ Wr
    dispatch_rows: int = 32      # BR
    dispatch_cols: int = 512     # BH
    rows: int = 128              # BM: rows per expert tile
    # Columns of a SwiGLU-backward task: one accumulator (g Wd) where the forward kept the
    # gate/up projections (H200, DeepSeek-V3 one-rank view: 2.24 ms busy per worker at 128,
    # 3.50 at 64; H100 80GB, stop 34, beside 256-column dx tiles: 1.91 at 256, 2.31 at 128).
    # A task that redoes the projections (three accumulators) runs as sub-tiles of
    # recompute_cols: 128 there makes ptxas serialize the kernel's wgmma (C7512).
    swiglu_cols: int = 256
    # The kept-projection SwiGLU-backward epilogue runs in column halves, or in quarters where a
    # quarter is at least this wide (256-column tiles).
    swiglu_epilogue_cols: int = 64
    recompute_cols: int = 64
    # BN of the dx tiles. 256 compiles beside 128 x 256 weight-gradient tiles only with
    # per-block weight-gradient loops (wgrad_block_loops; else C7512). H100 80GB, stop 34,
    # DeepSeek-V3 one-rank view: dx 2.95 against 3.85 ms busy per worker at 128.
    dx_cols: int = 256
    depth: int = 64              # BK
    wgrad_depth: int = 64        # BKW: rows per step of a weight-gradient reduction
    # BWM x BWN: the weight-gradient tiles. 128 x 256 against 128 x 128 (4 stages, beside
    # 128 x 128 router-gradient tiles; layer_backward.py variant wgrad_cols128), H100 80GB,
    # stop 32, forward+backward ms, one run: DeepSeek-V3 32 experts 21.57 / 22.22, Qwen3 16
    # experts 8.60 / 9.47, DeepSeek-V3 256 experts 43.16 / 43.20, Qwen3 128 experts 11.82 / 13.20
    # (weight gradients 5.56 / 6.55 ms busy per worker at DeepSeek-V3 32 experts).
    wgrad_rows: int = 128
    wgrad_cols: int = 256
    # BRM x BRN: the router weight's gradient tiles (fp32 operands, tf32x3 dots on the GPU).
    # Reduced 64 tokens a step (before stop 33), beside 128 x 256 weight-gradient tiles, 64 x
    # 128 or larger ones made ptxas serialize every wgmma of the kernel (C7512, offline sm_90,
    # Triton 3.6) and 64 x 64 did not. 64 x 64 cost most at 256 experts (stop 32, same runs:
    # route backward 3.52 against 1.83 ms busy per worker, router weight 1.11 against 0.50),
    # where the weight gradients gained as much. With
    # the reduction 32 tokens a step (router_grad_depth, stop 33), 64 x 128 and 128 x 128
    # compile without C7512; beside the flat strips of stop 33 they spilled more (2,272 and
    # 1,928 against 1,332 B, DeepSeek-V3 one-rank view), beside the per-block loops 128 x 128
    # spill 728 B against 760 (and less in all four benchmark cases). The default since stop
    # 35. H100 80GB, stop 35, one run each, 128 x 128 / 64 x 64 (variant router_grad64): the
    # backward's busy ms per worker summed over its tasks (the kernel is never idle, so this is
    # its time) DeepSeek-V3 256 experts 25.56 / 26.29 (router weight 0.50 / 1.09), 32 experts
    # 11.20 / 11.23, Qwen3 16 experts 5.15 / 5.27, 128 experts 7.84 / 7.98; forward+backward ms
    # 39.06 / 39.90, 19.09 / 18.82, 7.93 / 7.71, 11.95 / 11.61, where the unchanged forward
    # kernel's busy time moved as much (DeepSeek-V3 32 experts: 6.12 / 5.93 ms per worker).
    # The GPU backward suite passed on it (22, H100 80GB, stop 35), and with the training and
    # training-stack suites (26, stop 36).
    router_grad_rows: int = 128
    router_grad_cols: int = 128
    # BRK: tokens per step of the router-gradient reduction. 32 spills less than 64 (offline
    # sm_90, Triton 3.6, the whole kernel: 1,332 against 1,892 B at DeepSeek-V3 32 experts,
    # 1,952 against 2,984 at 256), and at DeepSeek-V3 the GEMM tasks ran faster for it. H100
    # 80GB, stop 33, forward+backward ms, 32 / 64 (variant router_depth64), one run each:
    # DeepSeek-V3 32 experts 20.81 / 21.14, 256 experts 40.26 / 41.22, Qwen3 16 experts 8.36 /
    # 8.49.
    router_grad_depth: int = 32
    fold_tokens: int = 16        # BTF
    fold_cols: int = 512         # BHF
    stages: int = 3
    warps: int = 8
    workers_per_sm: int = 1      # as Tiles.workers_per_sm
    # Pipeline stages of the dx tiles: 3.64 vs 4.30 ms busy per worker at 3 (DeepSeek-V3, 32
    # experts, H200). The SwiGLU-backward tiles fit only 3 in shared memory.
    dx_stages: int = 4
    # WS: column blocks per weight-gradient task, one pipelined loop. 16 vs 8: 51.3 vs 54.2 ms
    # forward+backward (DeepSeek-V3, 256 experts, H200). A task rereads its own block of rows
    # for each of its blocks, so where experts have many rows, the longer the strip, the more
    # such blocks are in use at once (benchmarks/wgrad_l2_model.py). H100 80GB, stop 50,
    # forward+backward ms, 16 / 8 / 4 (layer_backward.py variants strip8, strip4), first run:
    # DeepSeek-V3 32 experts 18.01 / 18.11 / 18.33, Qwen3 16 7.40 / 7.24 / 7.27, DeepSeek-V3
    # 256 36.29 / 36.60 / 37.71, Qwen3 128 11.17 / 11.08 / 11.26; 8 against 16 in the other
    # order 18.10 / 18.26, 7.31 / 7.46, 36.54 / 36.27, 11.15 / 11.27. At 4, DRAM read 11.5 GB
    # against 16.1 in the DeepSeek-V3 32-expert backward (stall_profile.py), its weight
    # gradients as long (4.97 ms busy per worker): those loops wait on latency, not DRAM bytes.
    wgrad_strip: int = 16
    # Where one strip would hold a whole row of dW[g;u] (hidden <= wgrad_strip * wgrad_cols, as
    # Qwen3's 4096 columns in 16 blocks), it holds half the row instead (wgrad_strip_for). Found
    # on the four benchmark cases only: 8 blocks gained at Qwen3 (hidden 4096) and tied or lost
    # at DeepSeek-V3 (7168, 28 blocks, strips of 16 + 12). H100 80GB, Triton 3.9, stop 56,
    # forward+backward ms, 16 / 8, one process each order (layer_backward.py variant strip8):
    # Qwen3 16 experts 7.49 / 7.30 and 7.48 / 7.32, Qwen3 128 10.54 / 10.56 and 10.62 / 10.53,
    # DeepSeek-V3 32 17.68 / 17.69 and 17.82 / 17.75, DeepSeek-V3 256 34.67 / 34.85 and 34.67 /
    # 34.87 (stop 50, Triton 3.6, above: the same pattern). Variant strip16 turns it off.
    wgrad_split_whole_rows: bool = True
    # Pipeline stages of the weight-gradient strips (both gradients share one loop, so one set
    # of buffers, 48 KB per stage at 128 x 256): with the flat strip loop 4 needed 229 KB of
    # shared memory, over sm_90's 227; with a loop per block the kernel takes 196,640 B. H100
    # 80GB, stop 34, forward+backward ms, 4 / 3 stages (variant wgrad_stages3), one run:
    # DeepSeek-V3 32 experts 18.42 / 18.73, 256 experts 39.63 / 39.87, Qwen3 16 experts 7.72 /
    # 7.80, 128 experts 11.59 / 11.65 (weight gradients 4.96 / 5.22 ms busy per worker at
    # DeepSeek-V3 32 experts). At 128 x 128 by pointer loads, H200, 3 / 4 / 5 stages:
    # DeepSeek-V3 rank view 22.96 / 22.59 / 22.68 ms, Qwen3 rank view 9.41 / 9.22 / 9.31.
    wgrad_stages: int = 4
    # Weight-gradient operands by TMA (descriptors over each expert's rows, made in the task)
    # where kosmos_moe.fused.backward_tma_usable allows, else by pointer loads. Plain grid on the
    # H200 (benchmarks/gemm_tiles.py, DeepSeek-V3 rank view, 128 x 128, 4 stages): dW[g;u]
    # about 560 vs 400 TFLOP/s by pointers, torch._grouped_mm 700.
    wgrad_tma: bool = True
    # With wgrad_tma, each finished weight-gradient block also leaves by TMA (a plain-grid probe
    # at 1,024 rows per expert gained 1-2%; in the kernel, beside 128 x 128 tiles, H100 80GB,
    # stop 32, DeepSeek-V3 32 experts: 22.03 against 22.11 ms forward+backward, one run; beside
    # 128 x 256 tiles in 3 stages, stop 35, DeepSeek-V3 256 experts: 39.83 against the 4-stage
    # default's 39.90).
    wgrad_tma_store: bool = False
    # The dx tiles' and (kept-projection) SwiGLU-backward tiles' rows and weight blocks by TMA,
    # descriptors made in the task, where kosmos_moe.fused.backward_tma_usable allows. Off: on
    # the H200 it made them slower (busy ms per worker, pointer loads vs TMA, DeepSeek-V3 rank
    # view: dx 3.74 vs 3.85, SwiGLU backward 2.26 vs 2.28; 256 experts: dx 6.22 vs 6.71).
    # Again beside today's 256-column tiles (H100 80GB, stop 53, forward+backward ms, pointer
    # loads / TMA, two processes): DeepSeek-V3 32 experts 18.07 / 18.19 and 18.15 / 18.17,
    # Qwen3 16 7.37 / 7.47 and 7.41 / 7.55, DeepSeek-V3 256 35.31 / 35.23 and 35.28 / 35.14,
    # Qwen3 128 10.78 / 10.80 and 10.87 / 10.76.
    tile_tma: bool = False
    # Each weight-gradient block its own pipelined loop instead of one flat loop over the
    # strip's blocks and row steps (tile_gemm.row_reduction_strip's BLOCK_LOOPS). Offline (sm_90,
    # Triton 3.6, DeepSeek-V3 one-rank view) the kernel's spills fall from 1,332 to 304 B, and
    # the 256-column dx and SwiGLU-backward tiles compile beside it without C7512. Each block
    # pays a pipeline fill and drain: at 256 experts (two row steps a block) the weight
    # gradients took 13.75 against 11.89 ms busy per worker, which the wider tiles made up.
    # H100 80GB, stop 34, forward+backward ms against the flat strips with 128-column dx and
    # SwiGLU-backward tiles (layer_backward.py variant flat_strips), one run: DeepSeek-V3 32
    # experts 18.81 / 20.58, Qwen3 16 experts 7.82 / 8.36, DeepSeek-V3 256 experts 40.09 /
    # 40.09, Qwen3 128 experts 11.67 / 11.71. Flat loops of 128 x 128 blocks for few-row experts
    # only (those of at most 256 or 512 rows, where a loop per block pays most; the other tiles
    # kept 256 columns) did not pay either: H100 80GB, stop 52, forward+backward ms, per block /
    # flat to 256 / to 512 rows, one process each order: DeepSeek-V3 256 experts 35.15 / 35.75 /
    # 35.69 and 35.27 / 35.59 / 35.62, Qwen3 128 10.78 / 10.68 / 10.74 and 10.75 / 10.75 /
    # 10.69, and DeepSeek-V3 32 (one process), where the path was compiled in but never taken
    # (its spills 1,368 against 676 B), 17.66 / 18.17 / 18.10. So that option was removed again.
    wgrad_block_loops: bool = True
    # The weight-gradient blocks stored (by pointer) with an L2 evict-first policy. At 256
    # experts they are 22.5 GB written once (DeepSeek-V3 at EP=1), likely pushing out of L2 the
    # rows the next blocks read. H100 80GB, stop 42, one run, forward+backward ms against no
    # hint (layer_backward.py variant wgrad_keep_in_l2): DeepSeek-V3 256 experts 36.60 / 37.90
    # (weight gradients 13.40 / 14.22 ms busy per worker), Qwen3 128 experts 11.21 / 11.31.
    # Stop 43, H100 80GB, one run each: DeepSeek-V3 256 experts 37.13 / 37.63, Qwen3 128 experts
    # 11.30 / 11.25, DeepSeek-V3 32 experts 18.22 / 18.40, Qwen3 16 experts 7.47 / 7.47.
    wgrad_evict_first: bool = True

    def __post_init__(self) -> None:
        check_tile_sizes(self)
        if self.swiglu_cols % self.recompute_cols:
            raise ValueError(
                f"swiglu_cols={self.swiglu_cols} must be a multiple of recompute_cols={self.recompute_cols}")

    def wgrad_strip_for(self, hidden: int) -> int:
        """Column blocks per weight-gradient task (``WS``) for a layer of ``hidden`` columns: the
        width of a dW[g;u] row. dWd's rows (the intermediate size wide) take the same strips."""
        blocks_per_row = -(-hidden // self.wgrad_cols)
        if self.wgrad_split_whole_rows and blocks_per_row <= self.wgrad_strip:
            return -(-blocks_per_row // 2)  # >= 1: MoEConfig refuses a hidden size below 1
        return self.wgrad_strip

    def kernel_constants(self, hidden: int) -> dict:
        """The backward kernel's tile constants for a layer of ``hidden`` columns (the
        :data:`COMPILE_OPTIONS` included)."""
        return dict(
            BT=self.route_tokens, BK_R=self.route_depth, BR=self.dispatch_rows, BH=self.dispatch_cols,
            BM=self.rows, BN_DH=self.swiglu_cols, BN_EPI=self.swiglu_epilogue_cols, BN_RC=self.recompute_cols,
            BN_DX=self.dx_cols, BK=self.depth,
            BKW=self.wgrad_depth, BWM=self.wgrad_rows, BWN=self.wgrad_cols, WS=self.wgrad_strip_for(hidden),
            BRM=self.router_grad_rows, BRN=self.router_grad_cols, BRK=self.router_grad_depth, BHR=self.route_cols,
            BTF=self.fold_tokens, BHF=self.fold_cols, STAGES=self.stages, DX_STAGES=self.dx_stages,
            WG_STAGES=self.wgrad_stages, RB_STAGES=self.route_stages, WG_BLOCK_LOOPS=self.wgrad_block_loops,
            WG_EVICT_FIRST=self.wgrad_evict_first, num_warps=self.warps, **PINNED_OPTIONS,
        )


GPU_BACKWARD_TILES = BackwardTiles()
# Where experts have few rows (128-256 each at 4096 tokens per rank), the weight-gradient blocks
# wait on their own fill, drain and store (stop 42, DeepSeek-V3 256 experts: 5.5 us a block, 1.4 at
# the dense rate). Two workers of one warpgroup per SM overlap one's waits with the other's wgmma,
# at tiles a warpgroup holds: 128 x 128 dx, SwiGLU-backward and weight-gradient tiles in 3 stages
# beside 64 x 64 router-gradient tiles and 32-column epilogues (offline sm_90a, Triton 3.9: 255
# registers, 98,328 B of shared memory, 2 blocks per SM; spills 624 / 740 B at Qwen3 128 experts,
# 808 / 1,156 at DeepSeek-V3 256). H100 80GB, stop 60, Triton 3.9, forward+backward ms, one worker /
# two per SM (layer_backward.py variants one_per_sm, two_per_sm), profiled run, then unprofiled in
# the other order: Qwen3 128 experts 10.44 / 9.96 and 10.50 / 9.99, DeepSeek-V3 256 34.26 / 33.10
# and 34.16 / 33.14; but Qwen3 16 experts 7.24 / 8.20 and DeepSeek-V3 32 17.65 / 20.27, where the
# 128 x 128 tiles' extra operand reads cost more than the overlap gains (dx 2.92 against 3.71 ms
# busy per worker). So from 128 local experts, and only where the forward keeps every row's gate/up
# projections (one rank, save_gate_up > 0): a kernel that may redo them compiles the
# three-accumulator SwiGLU-backward tiles, whose 3 stages take 135,168 B of shared memory, one block
# per SM (H100, Triton 3.6, a world of 3, stop 60: the launcher refused the grid before launching
# it; offline sm_90a, Triton 3.9, Qwen3 128 experts over 2 ranks, the same 135,168 B).
GPU_BACKWARD_TILES_TWO_PER_SM = replace(
    GPU_BACKWARD_TILES, warps=4, workers_per_sm=2, dx_cols=128, swiglu_cols=128, wgrad_cols=128, dx_stages=3,
    wgrad_stages=3, router_grad_rows=64, router_grad_cols=64, swiglu_epilogue_cols=32, recompute_cols=32,
)
TWO_PER_SM_FROM_EXPERTS = 128


def gpu_backward_tiles(local_experts: int, keeps_every_row: bool = True) -> BackwardTiles:
    """The GPU's backward tiles for a rank of ``local_experts`` experts: two workers of one
    warpgroup per SM from :data:`TWO_PER_SM_FROM_EXPERTS` on where the forward keeps every
    row's gate/up projections (``keeps_every_row``), else one worker of two warpgroups."""
    if keeps_every_row and local_experts >= TWO_PER_SM_FROM_EXPERTS:
        return GPU_BACKWARD_TILES_TWO_PER_SM
    return GPU_BACKWARD_TILES


# Strips of 2 blocks: the CPU shapes have 2-4 column blocks, so full and partial strips both run
# (not halved where 2 blocks are a whole row: wgrad_strip_for has its own test).
# The SwiGLU-backward epilogue in quarters, as the GPU's 256-column tiles.
INTERPRETER_BACKWARD_TILES = BackwardTiles(
    route_tokens=16, route_depth=16, route_cols=16, route_stages=1, dispatch_rows=16, dispatch_cols=32, rows=16,
    swiglu_cols=32, swiglu_epilogue_cols=8, recompute_cols=16, dx_cols=16, depth=16, wgrad_depth=16,
    wgrad_rows=16, wgrad_cols=16, router_grad_rows=16, router_grad_cols=16, router_grad_depth=16, fold_tokens=16,
    fold_cols=32, stages=1, warps=1, dx_stages=1, wgrad_strip=2, wgrad_split_whole_rows=False, wgrad_stages=1,
)


def backward_layout(
    config: MoEConfig, world: int, max_tokens: int, tiles: BackwardTiles, dtype: torch.dtype,
    rows_only: bool = False,
) -> WorkspaceLayout:
    """Lay out the backward workspace of one rank (same receive bound ``R`` as the forward).

    Activation-dtype buffers: received input rows and output-gradient rows ``2 x R x H``, the
    weighted activation ``R x I`` and ``[dg du]`` ``R x 2I`` for the weight gradients, and the
    combine buffer ``T x (K + 1) x H``. fp32: routing weights and ``dw`` partials per row, ``dw``
    per (token, k), ``d logits`` ``T x E``. int32: the forward's count tables and signals plus
    per-tile histograms and the token-ordered send lists. DeepSeek-V3 at ``T = 4096`` on one
    rank: about 2.2 GB.

    ``rows_only``: the layout of a standalone dispatch and combine (kosmos_moe.exchange), which
    move input rows and their results only: the output-gradient rows, the expert-backward
    buffers, the router-gradient buffers and the combine buffer's router slot take no space (at
    DeepSeek-V3, W = 8, T = 16384, that is 15 of 32 GB).
    """
    E, K, H = config.num_experts, config.top_k, config.hidden_size
    L = E // world
    I = config.moe_intermediate_size
    R = world * max_tokens * min(K, L)
    tile_cap = -(-R // tiles.rows) + L
    layout_tiles = -(-max_tokens // tiles.route_tokens)
    n_ib = -(-I // tiles.swiglu_cols)
    # The reset at the end of a call clears [arrived, hist) in one sweep: keep this order.
    word_sizes = [
        ("table", 2 * world * E),
        ("flag", world),
        ("arrived", world * L),
        ("dh_done", tile_cap),
        ("dh_exp", L),
        ("comb_arr", max_tokens),
        ("dw_arr", max_tokens),
        ("hist", layout_tiles * E),
        ("tpos", max_tokens * K),
        ("send_list", E * max_tokens),
        ("recv_src", R),
        ("recv_ent", R),
    ]
    es = torch.tensor([], dtype=dtype).element_size()
    grads = 0 if rows_only else 1
    byte_sizes = [
        ("recv_w", 4 * R),
        ("dw_part", grads * 4 * R * n_ib),
        ("dw_comb", grads * 4 * max_tokens * K),
        ("dlogits", grads * 4 * max_tokens * E),
        ("recv_x", es * R * H),
        ("recv_g", grads * es * R * H),
        ("hw", grads * es * R * I),
        ("dgu", grads * es * R * 2 * I),
        ("comb", es * max_tokens * (K + grads) * H),  # slot K: the router's part of grad_x
    ]
    words, offsets, pos = _pack(word_sizes, byte_sizes)
    if max(words.values()) >= 2**31 or R * 2 * max(H, I) >= 2**62:
        raise ValueError("workspace too large to index; lower max_tokens_per_rank")
    return WorkspaceLayout(max_tokens, world, R, tile_cap, words, offsets, pos)


def workspace_bytes(
    config: MoEConfig, world: int, max_tokens: int, dtype: torch.dtype = torch.bfloat16,
    tiles: Tiles = GPU_TILES, backward_tiles: BackwardTiles | None = None,
) -> dict[str, int]:
    """Bytes of one rank's fused workspaces, without allocating them: ``forward`` (every layer
    of ``backend="kosmos"``) and ``backward`` (allocated with the forward's when the layer's
    parameters require grad), at the GPU's default tiles for the default ``save_gate_up`` (above
    zero, so one rank keeps every row's projections: :func:`gpu_backward_tiles`'s
    ``keeps_every_row``). For planning memory: a layer holds both for its lifetime, and the
    layers of a model that share them (:func:`kosmos_moe.share_workspaces`) hold one pair per
    layout."""
    return {
        "forward": forward_layout(config, world, max_tokens, tiles, dtype).nbytes,
        "backward": backward_layout(config, world, max_tokens,
                                    backward_tiles or gpu_backward_tiles(config.num_experts // world, world == 1),
                                    dtype).nbytes,
    }
