#!/usr/bin/env bash
# Session 33's GPU calls (device tool, carry [".whl"]).
# STEP=first (~560 s warm, one call): what session 32 left unrun after its index_scores change
#   (a partial last program padded alone, not all C keys): the kernel's GPU tests and the
#   engine's GPU hierarchy tests; the launch-parameter sweep of index_scores at the decode
#   shape (HiSparse's exact indexer: B 8 x [1, 131104], f32 q; the launch default was chosen
#   for LeanSparse's B 64, C 2048), with the default alone for a bf16 q and the fp8 form; the
#   512K batch-8 decode profile (compare results/decode_profile_session32_indexer/b8_512k:
#   HiSparse's 160 us a layer of pad); all packed into session33_first.tar.
# STEP=final (~560 s warm): after index_scores' long-row launch rule (from STEP=first's sweep)
#   and the GPU hierarchy test's fix: the same GPU tests, the 512K batch-8 profile (packed into
#   session33_final.tar), then STEP=scale's run with the rest of the call.
# STEP=scale: configs/experiments/scale_small_batch_s32.gin (512K batches 8 and 1, five timed
#   blocks a cell) under $OUT/scale_small_batch_s32/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-first}" in
  first)
    TAIL=30 part gpu_tests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -x \
      tests/test_kernel_index_scores.py tests/test_gpu_hierarchy.py"
    sweep() { TAIL=22 part "$1" "$2" "python3 benchmarks/index_scores_sweep.py --shape decode \
      $3 --out \$OUT/sweep.json"; }
    sweep sweep_decode ${SWEEP_S:-200} "--budget-s $(( ${SWEEP_S:-200} - 60 ))"
    sweep sweep_decode_bf16 35 "--q-dtype bf16 --budget-s 0"
    sweep sweep_decode_fp8 35 "--fp8 --budget-s 0"
    profile b8_512k 524288 8 ${PROFILE_S:-140}
    pack session33_first ;;
  final)  # after the long-row launch rule: GPU tests, the 512K batch-8 profile, the scale run
    TAIL=30 part gpu_tests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -x \
      tests/test_kernel_index_scores.py tests/test_gpu_hierarchy.py"
    profile b8_512k 524288 8 ${PROFILE_S:-130}
    pack session33_final
    RUN=scale_small_batch_s32 SCALE_BUDGET=${SCALE_BUDGET:-260} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  tests)  # the engine's GPU tests with kernels (STEP=final's part stopped at its timeout)
    TAIL=30 part gpu_tests_engine ${TESTS_S:-400} "python3 -m pytest -q -m gpu -rA \
      tests/test_gpu_hierarchy.py tests/test_kernel_index_logits.py \
      tests/test_state_in_place.py tests/test_speculative.py" ;;
  scale)
    RUN=scale_small_batch_s32 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  *) echo "STEP=${STEP}: unknown (first | final | tests | scale)"; exit 2 ;;
esac
