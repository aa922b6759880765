#!/usr/bin/env bash
# Session 35's GPU calls (device tool, carry [".whl"]); none of these ran in session 35 (its
# device time went to session 34's calls).
# STEP=check (~450 s warm): the GPU tests of session 35's changes: sparse_attention with one
#   table shared by all requests (an HCA device pool read in place under the decode step's
#   vmap), the engine's GPU tests, then the 512K batch-8 decode profile at
#   attention_precision "bf16" with FP8 rows (where an HCA layer's decode is a sparse_attention
#   launch; at "f32" it stays in XLA).
# STEP=capacity: configs/experiments/capacity_s35.gin at CONTEXTS (default "(524288,)"; then
#   "(972800,)"), one context a call, under $OUT/capacity/capacity_s35/ (copy its results.json
#   to results/capacity_s35/ after each call: the next call resumes from it).
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-check}" in
  check)
    TAIL=30 part gpu_tests ${TESTS_S:-240} "python3 -m pytest -q -m gpu -rA \
      tests/test_kernel_sparse_attention.py tests/test_gpu_hierarchy.py"
    TAIL=40 part profile_b8_512k_bf16 ${PROFILE_S:-200} "python3 benchmarks/decode_profile_gpu.py \
      --methods hisparse,leansparse_fp8_jt --context 524288 --batch 8 --hlo-census \
      --gin \"model_preset.matmul_precision='bf16'\" \
      --gin \"model_preset.attention_precision='bf16'\" \
      --gin \"model_preset.kv_dtype='fp8_v4'\" \
      --out \$OUT --budget-s $(( ${PROFILE_S:-200} - 10 ))" ;;
  capacity) capacity capacity_s35 ;;  # resumes from results/capacity_s35/
  *) echo "STEP=${STEP}: unknown (check | capacity)"; exit 2 ;;
esac
