#!/usr/bin/env bash
# Session 37's GPU calls (device tool, carry [".whl"]):
# STEP=kc (~320 s): issue 16's deliver 5, the default kernel_compare config (all five ops,
# every implementation incl. pq_topc "jax_triton_fp8") from one run (the issue asks for an
# H200; session 37 asked for nvidia-h200 and was given an H100), each op's
# target shape first, with each timed program's kernels traced (busy / span us a call), until
# KC_BUDGET_S (default 300) -> $OUT/kc/kernel_compare/ (commit to results/kernel_compare/).
# Prepared for the next session (not yet run):
# STEP=serve: configs/experiments/capacity_s37.gin (capacity_s36 with fp8's session-37 pq
#   launch) at CONTEXTS (default "(524288,)"; then "(972800,)"), resumed from
#   results/capacity_s37/ (copy $OUT/capacity/capacity_s37/results.json there after a call).
# STEP=pq2 (~200 s): variants of that launch (benchmarks/pq_variants_gpu.py --set fp8_s38).
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-kc}" in
  kc)
    TAIL=60 part kc $(( ${KC_BUDGET_S:-300} + 150 )) "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=${KC_BUDGET_S:-300} \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  serve) capacity capacity_s37 ;;
  pq2)
    TAIL=20 part pq2 ${VARIANTS_S:-200} "python3 benchmarks/pq_variants_gpu.py --set fp8_s38 \
      --precisions fp8 --rounds 9 --repeats 20 --out \$OUT --budget-s $(( ${VARIANTS_S:-200} - 15 ))" ;;
  *) echo "STEP=${STEP}: unknown (kc | serve | pq2)"; exit 2 ;;
esac
