#!/usr/bin/env bash
# Session 36's prepared GPU calls (device tool, carry [".whl"]), one call each:
# STEP=pq (~400 s): the pq score kernel's launch variants (Params.prefetch, book_per_tile,
#   BN 128, 16 warps; session 36, CPU-tested under Triton's interpreter): their GPU tests
#   against the default launch and the XLA twin, then benchmarks/pq_variants_gpu.py (512K:
#   batch 64 contiguous, batch 36 paged; fp8 then bf16) -> $OUT/pq_variants/.
# STEP=profile (~250 s): the 512K batch-8 decode profile with bf16-stored weights and bf16
#   attention (capacity_s36's settings): how much of the step the shared GEMMs leave.
# STEP=serve: configs/experiments/capacity_s36.gin (bf16 weights and attention) at CONTEXTS
#   (default "(524288,)"; then "(972800,)"), under $OUT/capacity/capacity_s36/ (copy its
#   results.json to results/capacity_s36/ after each call: the next call resumes from it).
# 512K at batch 32 / 64 with FP8 rows is the scale script's:
#   RUN=scale_small_batch_fp8_s36 STEP=scale bash benchmarks/gpu_scale_batch.sh
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-pq}" in
  pq)
    TAIL=20 part pq_tests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -rA \
      tests/test_kernel_pq_topc.py -k 'launch_variants or jax_triton_random or fp8_against'"
    TAIL=40 part pq_variants ${VARIANTS_S:-280} "python3 benchmarks/pq_variants_gpu.py \
      --rounds 9 --repeats 20 --out \$OUT --budget-s $(( ${VARIANTS_S:-280} - 15 ))" ;;
  profile)
    PROFILE_GIN="--gin \"model_preset.weight_dtype='bf16'\" \
      --gin \"model_preset.attention_precision='bf16'\" --gin \"model_preset.kv_dtype='fp8_v4'\"" \
      profile profile_b8_512k_serving 524288 8 ${PROFILE_S:-240} ;;
  serve) capacity capacity_s36 ;;  # resumes from results/capacity_s36/
  *) echo "STEP=${STEP}: unknown (pq | profile | serve)"; exit 2 ;;
esac
