#!/usr/bin/env bash
# Session 37's GPU call (device tool, kind nvidia-h200, carry [".whl"]):
# STEP=kc (~450 s): issue 16's deliver 5, the default kernel_compare config (all five ops,
# every implementation incl. pq_topc "jax_triton_fp8") from one run on the H200, each op's
# target shape first, with each timed program's kernels traced (busy / span us a call), until
# KC_BUDGET_S (default 300) -> $OUT/kc/kernel_compare/ (commit to results/kernel_compare/).
# The capacity and pq-variant calls are benchmarks/gpu_session36.sh's STEP=serve / STEP=pq.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-kc}" in
  kc)
    TAIL=60 part kc $(( ${KC_BUDGET_S:-300} + 150 )) "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=${KC_BUDGET_S:-300} \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  *) echo "STEP=${STEP}: unknown (kc)"; exit 2 ;;
esac
