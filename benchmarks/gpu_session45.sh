#!/usr/bin/env bash
# Session 45's GPU calls (device tool, carry [".whl"]); the card (H100 or H200) is printed
# first and named in benchmarks/RESULTS.md:
# STEP=a (~300 s): the GPU tests of topk, candidate_topk, the miss filter and the split
#   top-512 (select's f32 compare, the finish's early stop, radix_search moved to topk.triton,
#   candidate_topk reading valid as is) -> $OUT/gputests/;
#   then launch_variants_gpu.py --set s45 (topk at 64 x 262144, k 2048: compare "float" /
#   "keys", the finish's early stop on / off, 8 finish warps, a floor hint; 15 rounds, and
#   device time a call from 3 profiles each) -> $OUT/lv/.
# (No GPU came in session 45. Session 46 ran STEP=min, STEP=kc with KC_BUDGET_S=120 and
# STEP=p512; STEP=a has not run.)
# STEP=min (~170 s): STEP a's fused-topk GPU tests (default, float, stop) and the s45 set in
#   5 rounds of 3 repeats, 2 profiles each (the device-time budget left for a last call).
# STEP=kc (~450 s): the default kernel_compare config, all five ops at issue 16's shapes,
#   traced (as gpu_session43.sh STEP=kc) -> $OUT/kc/.
# STEP=p512 (~230 s): the 512K batch-36 fp8 decode profile of hisparse and leansparse_fp8_jt
#   (as gpu_session44.sh STEP=b's second part; the paged indexer's query now quantized before
#   the kernel) -> $OUT/p512/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-a}" in
  a)
    TAIL=8 part gputests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py tests/test_kernel_candidate_topk.py \
      tests/test_kernel_miss_filter.py 'tests/test_kernel_index_scores.py::test_gpu_fp8_variants_at_v4_shape'"
    LV_ARGS="--busy 3" variants lv s45 15 ${LV_S:-150} ;;
  min)  # the least that says whether select's f32 compare is right and faster on a GPU
    TAIL=6 part gputests ${TESTS_S:-70} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py -k 'fused_on_gpu and (default or float or stop)'"
    LV_ARGS="--busy 2 --repeats 3" variants lv s45 ${LV_ROUNDS:-5} ${LV_S:-90} ;;
  kc)
    TAIL=60 part kc $(( ${KC_BUDGET_S:-300} + 150 )) "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=${KC_BUDGET_S:-300} \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  p512)
    PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-220} ;;
  *) echo "STEP=${STEP}: unknown (a | min | kc | p512)"; exit 2 ;;
esac
