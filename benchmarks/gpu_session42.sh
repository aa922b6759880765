#!/usr/bin/env bash
# Session 42's GPU calls (device tool, carry [".whl"]):
# STEP=fp8mma (~520 s): the Pallas kernels' e4m3 x e4m3 dots on fp8 wgmma
#   (pallas_kernels/fp8_dot.py):
#   1. their GPU tests (tests/test_fp8_dot.py; index_scores contiguous, paged, fused top-k;
#      the pq kernels' fp8 paths) -> $OUT/gputests/;
#   2. launch_variants_gpu.py --set s42: each fp8 kernel on wgmma against its widened form
#      (session 41's f16 mma.sync), 15 interleaved rounds -> $OUT/s42/ (commit to
#      results/launch_variants_s42/);
#   3. session 41's 512K batch-36 decode profile at score_precision "fp8" (gpu_session40.sh
#      STEP=fp8) with these kernels -> $OUT/profile_b36_512k_p03_fp8/ (commit to
#      results/profile_b36_512k_p03_fp8_s42/).
# STEP=p950fp8 (~260 s): gpu_session41.sh's 950K batch-20 profile at score_precision "fp8"
#   with these kernels -> $OUT/profile_b20_950k_p03_fp8/ (commit to
#   results/profile_b20_950k_p03_fp8_s42/).
# STEP=kc42 (~150 s; prepared, not yet run): kernel_compare at
#   index_scores' issue-16 shape with the fp8 kernels on wgmma
#   (configs/experiments/kernel_compare_s42_index.gin) -> $OUT/kc/kernel_compare_s42_index/.
# Session 41's queue (gpu_session41.sh) stands: STEP=colaunch, STEP=serve41, STEP=p950.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-fp8mma}" in
  fp8mma)
    TAIL=12 part gputests ${TESTS_S:-130} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_fp8_dot.py tests/test_kernel_index_scores.py \
      tests/test_kernel_index_scores_paged.py 'tests/test_kernel_pq_topc.py::test_gpu_fp8_against_its_reference'"
    variants s42 s42 15 ${LAUNCH_S:-150}
    PROFILE_GIN=$FP8_GIN profile profile_b36_512k_p03_fp8 524288 36 ${PROFILE_S:-210} ;;
  p950fp8) PROFILE_GIN=$FP8_GIN profile profile_b20_950k_p03_fp8 972800 20 ${PROFILE_S:-260} ;;
  kc42)
    TAIL=30 part kc ${KC_S:-150} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s42_index.gin 2>&1 | grep -v ' spent$'" ;;
  *) echo "STEP=${STEP}: unknown (fp8mma | p950fp8 | kc42)"; exit 2 ;;
esac
