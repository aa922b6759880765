#!/usr/bin/env bash
# Session 38's GPU calls (device tool, carry [".whl"]):
# STEP=pqw4 (~60 s): benchmarks/pq_variants_gpu.py --set fp8_w4, 25 interleaved rounds of 50
#   calls (fp8_s38's 9 rounds of 20 were too noisy to rank 4 warps; results/pq_variants_s38/).
# STEP=serve: configs/experiments/capacity_s37.gin at CONTEXTS (default "(524288,)"), resumed
#   from results/capacity_s37/. Its committed 524288 cells ran fp8's 8-warp launch (session
#   37's), its 972800 cells the 4-warp launch (FP8_PARAMS since session 38, as any rerun).
# STEP=serve38: configs/experiments/capacity_s38.gin (the same with the 4-warp launch).
# STEP=pqkc (~250 s): the GPU tests of pq_topc (fp8's launch now 4 warps), then kernel_compare
#   at pq_topc's target shape (B 64, N 131072) with every call traced ->
#   $OUT/kc/kernel_compare_s38_pq/ (commit to results/kernel_compare_s38_pq/).
# STEP=launch (~300 s; prepared, not yet run): benchmarks/launch_variants_gpu.py, the launch
#   tunables of topk, sparse_attention and index_scores in interleaved rounds at their issue-16
#   target shapes -> $OUT/launch/ (commit to results/launch_variants_s39/); then the pq score
#   kernel's bf16 launch with 4 warps (pq_variants_gpu.py --set bf16_w4) -> $OUT/pqbf16/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-pqw4}" in
  pqw4)
    TAIL=12 part pqw4 ${VARIANTS_S:-150} "python3 benchmarks/pq_variants_gpu.py --set fp8_w4 \
      --precisions fp8 --rounds 25 --repeats 50 --out \$OUT --budget-s $(( ${VARIANTS_S:-150} - 15 ))" ;;
  serve) capacity capacity_s37 ;;
  serve38) capacity capacity_s38 ;;
  pqkc)  # fp8's 4-warp launch: its GPU tests, then kernel_compare's pq_topc target shape traced
    TAIL=8 part gpu_tests ${TESTS_S:-150} "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_pq_topc.py -k 'launch_variants or fp8 or jax_triton'"
    TAIL=30 part kc ${KC_S:-200} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s38_pq.gin 2>&1 | grep -v ' spent$'" ;;
  launch)  # prepared in session 38, not yet run
    TAIL=40 part launch ${LAUNCH_S:-300} "python3 benchmarks/launch_variants_gpu.py --out \$OUT \
      --budget-s $(( ${LAUNCH_S:-300} - 20 ))"
    TAIL=14 part pqbf16 ${VARIANTS_S:-150} "python3 benchmarks/pq_variants_gpu.py --set bf16_w4 \
      --precisions bf16 --rounds 25 --repeats 50 --out \$OUT --budget-s $(( ${VARIANTS_S:-150} - 15 ))" ;;
  *) echo "STEP=${STEP}: unknown (pqw4 | serve | serve38 | pqkc | launch)"; exit 2 ;;
esac
