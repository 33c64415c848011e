#!/usr/bin/env bash
# The GPU checks behind the README's figures, in stages sized for one 10-minute run each on one
# H200, compile included, from the script times in benchmarks/README.md (the test stages ran
# 200-330 s in earlier sessions without a Triton cache). From the repository root:
#
#   bash benchmarks/gpu_session.sh STAGE [STAGE ...]
#
# Each stage writes STAGE.log (and the benchmarks' JSON) under $OUT, or results/gpu_session
# when OUT is unset, and the script goes on to the next stage when one fails, ending with the
# first failure's status. Stages:
#
#   tests-backward   the backward and training GPU suites (emulated worlds of 1-8 ranks), and
#                    autocast, shared workspaces and torch.compile on one rank
#   tests-forward    the forward, signals, exchange and distributed GPU suites
#   forward          layer_forward.py on the four EP=1 cases (the forward table)
#   backward         layer_backward.py --profile on the four cases (the forward+backward table;
#                    the profiled step also logs how far apart each launch's workers left)
#   variants-forward layer_forward.py on the four EP=1 cases, the default against the forward
#                    variants last timed (two workers per SM, the table in
#                    benchmarks/FINDINGS.md), after the GPU tests of those tiles
#   variants         layer_backward.py --profile, DeepSeek-V3 32 experts and Qwen3 16 experts,
#                    the default against the stop 33 tiles (flat weight-gradient strips,
#                    128-column dx and SwiGLU-backward tiles), each wide tile narrowed alone,
#                    and 3-stage weight-gradient loops
#   variants-full    the same at DeepSeek-V3 256 experts (two row steps per weight-gradient
#                    block, where a loop per block costs most), the blocks stored by TMA
#                    (their stores overlap the next block's loads) and the 64 x 64
#                    router-gradient tiles (the default until stop 35; most router work there)
#   variants-wgrad   layer_backward.py --profile on the four EP=1 cases, the default (weight-
#                    gradient blocks stored with an L2 evict-first policy since stop 42)
#                    against the blocks without the hint
#   variants-route   layer_forward.py on the four EP=1 cases, the default against route steps
#                    128 deep and the route tiles' staging before stop 38
#   variants-weights the GPU test of the weight descriptors' 256-byte L2 promotion (the default
#                    since stop 45), then layer_forward.py on the four EP=1 cases, the default
#                    against ways the routed tiles' weight copies were made to wait less or
#                    more (stop 39: 20% of the forward's warp time at Qwen3 128 experts):
#                    Triton's 128-byte promotion (weights_l2_128), or 4 pipeline stages for
#                    the gate/up tiles as for the down tiles (stages4)
#   variants-lookup  layer_forward.py on the four EP=1 cases, each tile's expert entries looked
#                    up in one reduction at any expert count against never (the default does it
#                    from 256 local experts, Tiles.merged_lookup_from), in both orders
#   variants-strips  layer_backward.py --profile at DeepSeek-V3 32 and Qwen3 16 experts, the
#                    default (16 blocks per weight-gradient task) against 8 and 4 blocks
#                    (strip8, strip4: fewer row blocks reread at once, benchmarks/
#                    wgrad_l2_model.py), then unprofiled in the other order
#   variants-strips-full  the same at 256 and 128 experts, both orders unprofiled
#   variants-claim   layer_forward.py on the four EP=1 cases, the default (gate/up tickets claimed
#                    in the pass that reaches their queue, since stop 51) against claimed a tile
#                    ahead (gate_up_claim_ahead, Tiles.gate_up_claim_ahead), in both orders
#   variants-stages  layer_forward.py on the four EP=1 cases, the default (4 gate/up stages from 128
#                    local experts, 3 below) against 3 and 4 everywhere (stages3, stages4), in
#                    both orders
#   stalls-claim     stall_profile.py on the forward at Qwen3 128 and DeepSeek-V3 32 experts, the
#                    default, then Qwen3 128 with gate_up_claim_ahead: DRAM bytes read and the L2
#                    fabric's share
#   stalls-strips    stall_profile.py on the backward at DeepSeek-V3 32 experts, strip4 then
#                    the default: DRAM bytes read against every buffer read once
#   stalls-shared    stall_profile.py on the forward at DeepSeek-V3 32 experts without its shared
#                    expert, then with it: whether the shared tiles, which run only when no
#                    routed task is ready, account for the reads beyond each buffer once
#   stalls-backward-full  stall_profile.py on the backward at Qwen3 128 and DeepSeek-V3 256 experts,
#                    the two forward+backward cases below 1.4x: whether L2 (as in the Qwen3
#                    128-expert forward, stop 51: 93% of its throughput) or DRAM bounds them,
#                    packed as stalls_backward_full.tgz
#   tiles            gemm_tiles.py: the tile GEMMs and weight-gradient strips on their own
#   stalls           stall_profile.py under Nsight Compute: the forward at DeepSeek-V3 32 and
#                    Qwen3 128 experts, the backward at DeepSeek-V3 32, packed as stalls.tgz (a
#                    device call returns at most eight files; the profiles write five each)
#   host-blocking    host_blocking.py (which host operations wait for running kernels), then the
#                    backward tests that stalled with a shared expert in emulated worlds (stop 28)
#   triton-versions  layer_backward.py --profile on the four EP=1 cases under the image's Triton,
#                    then under the Triton packed in $CARRIED_TRITON (default
#                    .carry/triton-3.9.0.tar.xz), then layer_forward.py under the carried one and
#                    the image's: whether a newer Triton compiles faster kernels (stop 54)
#   variants-tma-strip  layer_backward.py --profile on the four EP=1 cases, the default against
#                    the dx and SwiGLU-backward operands by TMA (tile_tma) and 8 blocks a
#                    weight-gradient task (strip8): both lost or barely paid under Triton 3.6,
#                    and under 3.9 tile_tma's loops compile to a third fewer instructions (stop
#                    54); meant to run with WITH_TRITON
#   variants-strip-rule  layer_backward.py unprofiled on the four EP=1 cases, the default (since
#                    stop 56 a weight-gradient task holds half a dW[g;u] row where 16 blocks would
#                    hold all of it: 8 at Qwen3) against 16 blocks everywhere (strip16) and the
#                    blocks stored by TMA in 3 stages (wgrad_tma_store, untimed under Triton 3.9),
#                    then cases and variants in the reverse order
#   variants-k32     layer_backward.py unprofiled on the four EP=1 cases, the default against
#                    32-row weight-gradient steps in 6 stages with the blocks stored by TMA
#                    (wgrad_k32_tma_store; 64-row steps leave that store 3) and in 8 stages
#                    stored by pointer (wgrad_k32_stages8), then in the reverse order; meant to
#                    run with WITH_TRITON
#   variants-workers layer_backward.py unprofiled on the four EP=1 cases, the default (two workers
#                    per SM from 128 local experts, since stop 60) against one worker per SM
#                    (one_per_sm), two everywhere (two_per_sm) and two with 2 SwiGLU-backward
#                    stages (two_per_sm_stages2, which would fit two per SM with several ranks
#                    too), then in the reverse order, after the GPU test of the two-per-SM tiles;
#                    meant to run with WITH_TRITON
#
# WITH_TRITON=.carry/triton-VERSION.tar.xz runs every stage under that Triton instead of the
# image's (benchmarks/carry_triton.sh packs one; name .carry in the device call's carry).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-results/gpu_session}"

# The environment (NAME=VALUE words) that imports the Triton packed in $1 before the image's: the
# package unpacked once under /tmp, only its NVIDIA backend discovered (the image's entry points
# name an AMD one the pack leaves out), and the image's CUDA ptxas for it (the pack has none).
carried_triton() {
    local dir="/tmp/carried_triton/$(basename "$1" .tar.xz)" ptxas
    [ -f "$1" ] || { echo "no packed Triton at $1 (benchmarks/carry_triton.sh)" >&2; return 1; }
    [ -d "$dir/triton" ] || { mkdir -p "$dir" && tar -C "$dir" -xJf "$1"; } || return 1
    ptxas="$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)"
    echo "PYTHONPATH=$dir:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_PATH=$ptxas" \
         "TRITON_PTXAS_BLACKWELL_PATH=$ptxas TRITON_DEFAULT_FP_FUSION=1"
}
if [ -n "${WITH_TRITON:-}" ]; then
    settings="$(carried_triton "$WITH_TRITON")" || exit 1
    export $settings
fi
mkdir -p "$out"
[ $# -gt 0 ] || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 2; }

# Pack the profiles under $out/stalls as $out/NAME.tgz (a device call returns at most eight files),
# then return STATUS, the profiles' own.
pack_profiles() {
    tar czf "$out/$2.tgz" -C "$out" stalls && rm -rf "$out/stalls" && return "$1"
}

run_stage() {
    case "$1" in
        tests-backward) python -m pytest -q -x tests/test_fused_backward_gpu.py tests/test_training_gpu.py \
                            tests/test_training_stack_gpu.py ;;
        tests-forward) python -m pytest -q -x tests/test_fused_gpu.py tests/test_route_tile_gpu.py tests/test_signals_gpu.py \
                           tests/test_exchange_gpu.py tests/test_distributed_gpu.py ;;
        forward) python benchmarks/layer_forward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                     --out "$out/forward.json" ;;
        backward) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                      --profile --out "$out/backward.json" ;;
        variants-forward) python -m pytest -q tests/test_fused_gpu.py -k "two_workers_per_sm or residency" && \
                          python benchmarks/layer_forward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                              --out "$out/variants_forward.json" --variants default two_per_sm two_per_sm_rows64 ;;
        variants) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank --profile \
                      --out "$out/variants.json" \
                      --variants default flat_strips dx_cols128 swiglu_cols128 wgrad_stages3 ;;
        variants-full) python benchmarks/layer_backward.py --cases dsv3_full --profile \
                           --out "$out/variants_full.json" --variants default flat_strips wgrad_stages3 \
                               router_grad64 wgrad_tma_store ;;
        variants-wgrad) python benchmarks/layer_backward.py --cases dsv3_full qwen3_full dsv3_rank qwen3_rank \
                            --profile --out "$out/variants_wgrad.json" \
                            --variants default wgrad_keep_in_l2 ;;
        variants-route) python benchmarks/layer_forward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                            --out "$out/variants_route.json" --variants default route_depth128 route_stages2 ;;
        variants-weights) python -m pytest -q tests/test_fused_gpu.py -k weight_l2_promotion && \
                          python benchmarks/layer_forward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                              --out "$out/variants_weights.json" \
                              --variants default weights_l2_128 stages4 ;;
        variants-lookup) python benchmarks/layer_forward.py --cases dsv3_full qwen3_full dsv3_rank qwen3_rank \
                             --out "$out/variants_lookup.json" --variants separate_lookup merged_lookup && \
                         python benchmarks/layer_forward.py --cases dsv3_full qwen3_full dsv3_rank qwen3_rank \
                             --out "$out/variants_lookup_reversed.json" --variants merged_lookup separate_lookup ;;
        variants-strips) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank --profile \
                             --out "$out/variants_strips.json" --variants default strip8 strip4 && \
                         python benchmarks/layer_backward.py --cases qwen3_rank dsv3_rank \
                             --out "$out/variants_strips_reversed.json" --variants strip4 strip8 default ;;
        variants-strips-full) python benchmarks/layer_backward.py --cases dsv3_full qwen3_full \
                                  --out "$out/variants_strips_full.json" --variants default strip8 strip4 && \
                              python benchmarks/layer_backward.py --cases qwen3_full dsv3_full \
                                  --out "$out/variants_strips_full_reversed.json" --variants strip4 strip8 default ;;
        variants-claim) python benchmarks/layer_forward.py --cases qwen3_full dsv3_full dsv3_rank qwen3_rank \
                            --out "$out/variants_claim.json" --variants default gate_up_claim_ahead && \
                        python benchmarks/layer_forward.py --cases qwen3_full dsv3_full dsv3_rank qwen3_rank \
                            --out "$out/variants_claim_reversed.json" --variants gate_up_claim_ahead default ;;
        variants-stages) python benchmarks/layer_forward.py --cases qwen3_full dsv3_rank dsv3_full qwen3_rank \
                             --out "$out/variants_stages.json" --variants default stages3 stages4 && \
                         python benchmarks/layer_forward.py --cases qwen3_full dsv3_rank dsv3_full qwen3_rank \
                             --out "$out/variants_stages_reversed.json" --variants stages4 stages3 default ;;
        stalls-claim) python benchmarks/stall_profile.py --case qwen3_full --out "$out/stalls" && \
                      python benchmarks/stall_profile.py --case dsv3_rank --out "$out/stalls" && \
                      python benchmarks/stall_profile.py --case qwen3_full --variant gate_up_claim_ahead \
                          --out "$out/stalls"; \
                      pack_profiles $? stalls_claim ;;
        stalls-strips) python benchmarks/stall_profile.py --case dsv3_rank --backward --variant strip4 \
                           --out "$out/stalls" && \
                       python benchmarks/stall_profile.py --case dsv3_rank --backward --out "$out/stalls"; \
                       pack_profiles $? stalls_strips ;;
        stalls-shared) python benchmarks/stall_profile.py --case dsv3_rank --no-shared --out "$out/stalls" && \
                       python benchmarks/stall_profile.py --case dsv3_rank --out "$out/stalls"; \
                       pack_profiles $? stalls_shared ;;
        stalls-backward-full) python benchmarks/stall_profile.py --case qwen3_full --backward --out "$out/stalls" && \
                              python benchmarks/stall_profile.py --case dsv3_full --backward --out "$out/stalls"; \
                              pack_profiles $? stalls_backward_full ;;
        tiles) python benchmarks/gemm_tiles.py --out "$out/tiles.json" ;;
        variants-tma-strip) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                                --profile --out "$out/variants_tma_strip.json" --variants default tile_tma strip8 ;;
        variants-strip-rule) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                                 --out "$out/variants_strip_rule.json" --variants default strip16 wgrad_tma_store && \
                             python benchmarks/layer_backward.py --cases qwen3_full dsv3_full qwen3_rank dsv3_rank \
                                 --out "$out/variants_strip_rule_reversed.json" \
                                 --variants wgrad_tma_store strip16 default ;;
        variants-k32) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                          --out "$out/variants_k32.json" --variants default wgrad_k32_tma_store wgrad_k32_stages8 && \
                      python benchmarks/layer_backward.py --cases qwen3_full dsv3_full qwen3_rank dsv3_rank \
                          --out "$out/variants_k32_reversed.json" \
                          --variants wgrad_k32_stages8 wgrad_k32_tma_store default ;;
        variants-workers) python -m pytest -q tests/test_fused_backward_gpu.py -k two_workers_per_sm && \
                          python benchmarks/layer_backward.py --cases qwen3_full dsv3_full qwen3_rank dsv3_rank \
                              --out "$out/variants_workers.json" --variants default one_per_sm two_per_sm two_per_sm_stages2 && \
                          python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                              --out "$out/variants_workers_reversed.json" \
                              --variants two_per_sm_stages2 two_per_sm one_per_sm default ;;
        triton-versions) python benchmarks/layer_backward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                             --profile --out "$out/backward_image_triton.json" && \
                         carried="$(carried_triton "${CARRIED_TRITON:-.carry/triton-3.9.0.tar.xz}")" && \
                         env $carried python benchmarks/layer_backward.py \
                             --cases dsv3_rank qwen3_rank dsv3_full qwen3_full --profile \
                             --out "$out/backward_carried_triton.json" && \
                         env $carried python benchmarks/layer_forward.py \
                             --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                             --out "$out/forward_carried_triton.json" && \
                         python benchmarks/layer_forward.py --cases dsv3_rank qwen3_rank dsv3_full qwen3_full \
                             --out "$out/forward_image_triton.json" ;;
        stalls) python benchmarks/stall_profile.py --case dsv3_rank --out "$out/stalls" && \
                    python benchmarks/stall_profile.py --case qwen3_full --out "$out/stalls" && \
                    python benchmarks/stall_profile.py --case dsv3_rank --backward --out "$out/stalls"; \
                    pack_profiles $? stalls ;;
        host-blocking) python benchmarks/host_blocking.py --out "$out/host_blocking.json"; first=$?; \
                           KOSMOS_SAMPLE_STACKS="$out/stacks" python -m pytest -q \
                           "tests/test_fused_backward_gpu.py::test_other_router_shared_combinations[softmax_shared]" \
                           "tests/test_fused_backward_gpu.py::test_backward_matches_reference[sigmoid_group_shared-4]" \
                           "tests/test_fused_backward_gpu.py::test_backward_matches_reference[sigmoid_group_shared-8]" \
                           && return $first ;;
        *) echo "unknown stage $1" >&2; return 2 ;;
    esac
}

status=0
for stage in "$@"; do
    echo "== $stage ($(date -u +%H:%M:%S))"
    start=$SECONDS
    run_stage "$stage" > "$out/$stage.log" 2>&1
    rc=$?
    tail -n 25 "$out/$stage.log"
    echo "== $stage: exit $rc after $((SECONDS - start)) s"
    [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
done
exit $status
