#!/usr/bin/env bash
# What session 31 left for the next GPU calls (device tool, carry [".whl"]); everything under
# $OUT comes back in one tar (STEP=profile) or as the scale run's files.
# STEP=profile (default; ~330 s warm, one call): the decode profiles with candidate_topk's
#   launch default of 256 lanes (session 31's sweep; 30 us a CSA layer in the step at 128 lanes):
#   128K at batch 1 and 8 (compare results/decode_profile_session31/b{1,8}), and 512K at
#   batch 8, where issue 13's <= 0.85 is 0.86-0.89 (not profiled since the sort removal: where
#   LeanSparse's 3.2-3.4 ms go against HiSparse's 3.7-3.8). Each with the HLO census; read the
#   traces' idle gaps with benchmarks/trace_gaps.py.
# STEP=indexer (~480 s warm, one call; after session 32's decode indexer change: HiSparse's
#   exact scores of the FP8 keys by the index_scores kernel): the GPU tests of the engine with
#   kernels (hisparse == resident, LeanSparse against XLA, speculative and in-place state),
#   then the decode profiles at 512K and 128K batch 8 (compare $OUT's b8_512k with the
#   STEP=profile one: HiSparse's indexer was ~0.43 ms a CSA layer of XLA fusions there).
# STEP=scale (~300 s, one call): 512K batches 8 and 1 in five timed blocks a cell
#   (configs/experiments/scale_small_batch_s32.gin); copy $OUT/scale_small_batch_s32/ into
#   results/ and regenerate the README table (the ratio then shows the blocks' range).
# STEP=b64 (~200 s, one call, fresh process): 512K batch 64, killed in session 31 as the
#   fourth cell of one process; free memory and /tmp usage are logged before and after.
source "$(dirname "$0")/gpu_lib.sh"
memory() { free -g | head -2; df -h /tmp | tail -1; du -sh /tmp/lsparse_scale_prefill 2>/dev/null; }
case "${STEP:-profile}" in
  profile)
    profile b1 131072 1 100
    profile b8 131072 8 100
    profile b8_512k 524288 8 150
    pack session32_profile ;;
  indexer)
    TAIL=30 part gpu_tests ${TESTS_S:-250} "python3 -m pytest -q -m gpu -x \
      tests/test_kernel_index_scores.py tests/test_gpu_hierarchy.py \
      tests/test_kernel_index_logits.py tests/test_state_in_place.py tests/test_speculative.py"
    profile b8_512k 524288 8 140
    # OLD=1 (a machine other than call 1's): HiSparse before the change, from the snapshot
    # .branches/old_b8_512k of 13a4f5e (carried; part() runs a part from .branches/NAME)
    [ -n "${OLD:-}" ] && METHODS=hisparse profile old_b8_512k 524288 8 100
    profile b8 131072 8 90
    pack session32_indexer ;;
  final)  # session 32's last call: the kernels' GPU tests, then STEP=scale's run
    TAIL=30 part gpu_tests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -x \
      tests/test_kernel_index_scores.py tests/test_gpu_hierarchy.py"
    STEP=scale SCALE_BUDGET=${SCALE_BUDGET:-260} bash "$0" ;;
  scale)
    RUN=scale_small_batch_s32 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  b64)
    memory
    RUN=scale_small_batch_s30 SCALE_BUDGET=${SCALE_BUDGET:-400} \
      SCALE_ARGS="--gin.scale.batches=(64,)" STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh"
    memory ;;
  *) echo "STEP=${STEP}: unknown (profile | indexer | final | scale | b64)"; exit 2 ;;
esac
