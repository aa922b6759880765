#!/usr/bin/env bash
# Session 49's GPU calls (device tool, carry [".whl"]); the card is printed first.
# STEP=a (~250 s): the GPU tests of topk (every fused variant, the new default finish: two
#   programs a row, prefix sums through 64 rows, skip_ties), candidate_topk and index_scores
#   (searches by thirds after the literal fix) -> $OUT/gputests/; kernel_compare's topk rows
#   (xla against triton_fused, 64 x 262144, k 2048, profiled) -> $OUT/kc/.
# STEP=kc (~300 s; cut at 280 s in session 49, after every target shape): kernel_compare's
#   default config (per call, batched in one program) -> $OUT/kc/.
# STEP=p512 (~220 s): the 512K batch-36 fp8 decode profile (as gpu_session47.sh STEP=d's
#   p512 part) with the new topk finish -> $OUT/p512/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-a}" in
  a)
    TAIL=8 part gputests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py tests/test_kernel_candidate_topk.py \
      tests/test_kernel_index_scores.py"
    TAIL=12 part kc ${KC_S:-120} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin \"--gin.kernel_compare.ops=('topk',)\" \
      \"--gin.kernel_compare.topk_shapes=((64, 262144, 2048),)\" \
      \"--gin.kernel_compare.implementations=('xla', 'triton_fused')\" \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  kc)
    TAIL=30 part kc ${KC_S:-280} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin 2>&1 | grep -v ' spent$'" ;;
  p512) PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-210} ;;
  *) echo "STEP=${STEP}: unknown (a | kc | p512)"; exit 2 ;;
esac
