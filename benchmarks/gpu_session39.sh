#!/usr/bin/env bash
# Session 39's GPU calls (device tool, carry [".whl"]):
# STEP=launch2 (~150 s): benchmarks/launch_variants_gpu.py --set s39, combinations of what won
#   session 39's first run of the one-at-a-time set (results/launch_variants_s39/first/), 25
#   rounds -> $OUT/launch2/ (commit to results/launch_variants_s39/); then the pq_topc GPU
#   tests with bf16's new default launch (jax_triton.BF16_PARAMS) and kernel_compare at the
#   op's target shape, traced -> $OUT/kc/kernel_compare_s39_pq/.
# STEP=attn (~250 s): launch_variants_gpu.py --set s39b (sparse_attention: bf16 rows' new
#   3-stage default against 2 stages; FP8 rows' tunables) -> $OUT/attn/ (commit to
#   results/launch_variants_s39/attention/); the sparse_attention GPU tests; kernel_compare at
#   its target shape, traced -> $OUT/kc/kernel_compare_s39_attention/.
# STEP=third (~150 s): launch_variants_gpu.py --set s39c (topk finish_warps 16, index_scores
#   warps / steps: split results in s38 and s39), 35 rounds -> $OUT/third/ (commit to
#   results/launch_variants_s39/third/).
# STEP=ti (~400 s): GPU tests of topk (finish / threshold kernels 16 warps since session 39)
#   and index_scores (rescoring 8 warps x 4 blocks at B 64, C 2048), MORE_TESTS (more test
#   files); kernel_compare at topk's and index_scores' target shapes, traced ->
#   $OUT/kc/kernel_compare_s39_topk_index/.
# STEP=serve39: configs/experiments/capacity_s39.gin (capacity_s38 with those launches) at
#   CONTEXTS (default "(524288,)") -> $OUT/capacity/capacity_s39/.
# STEP=topk40 (~250 s; prepared, not yet run): the GPU test of topk's select loop with
#   prefetch (fused_config(prefetch=True)), then launch_variants_gpu.py --set s40 (prefetch
#   with chunk 2048 / 1024 or 16 warps against the default), 35 rounds -> $OUT/topk40/.
# STEP=profile36 (~420 s; prepared, not yet run): the decode profile (per-op kernel times,
#   HLO census) of HiSparse and LeanSparse (FP8 jax-triton coarse pass) at issue 13's operating
#   point, 512K, batch 36, trained-like reuse (input_repeat 0.3), bf16 weights and attention,
#   FP8 rows; session 37's profile was batch 8 with random inputs (0.4% reuse). It runs
#   scale.gin's cells (C 2048, 4096-row key cache, a 4096-row KV hot cache for both methods,
#   where capacity.gin gives LeanSparse 2048) -> $OUT/profile_b36_512k_p03/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-launch2}" in
  launch2)
    variants launch2 s39 25 ${LAUNCH_S:-200}
    TAIL=8 part gpu_tests ${TESTS_S:-150} "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_pq_topc.py -k 'launch_variants or jax_triton or bf16'"
    TAIL=30 part kc ${KC_S:-150} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s39_pq.gin 2>&1 | grep -v ' spent$'" ;;
  attn)
    variants attn s39b 25 ${LAUNCH_S:-150}
    TAIL=8 part gpu_tests ${TESTS_S:-150} "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_sparse_attention.py"
    TAIL=12 part kc ${KC_S:-150} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s39_attention.gin 2>&1 | grep -v ' spent$'" ;;
  third) variants third s39c 35 ${LAUNCH_S:-150} ;;
  ti)
    TAIL=8 part gpu_tests ${TESTS_S:-220} "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_topk.py tests/test_kernel_topk_nosync.py tests/test_kernel_index_scores.py \
      tests/test_kernel_index_scores_paged.py ${MORE_TESTS:-}"
    TAIL=20 part kc ${KC_S:-200} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s39_topk_index.gin 2>&1 | grep -v ' spent$'" ;;
  serve39) capacity capacity_s39 ;;
  topk40)  # prepared in session 39, not yet run
    TAIL=8 part gpu_tests ${TESTS_S:-150} "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_topk.py -k prefetch"
    variants topk40 s40 35 ${LAUNCH_S:-150} ;;
  profile36)  # prepared in session 39, not yet run
    PROFILE_GIN="--gin \"model_preset.weight_dtype='bf16'\" \
      --gin \"model_preset.attention_precision='bf16'\" --gin \"model_preset.kv_dtype='fp8_v4'\" \
      --input-repeat 0.3" profile profile_b36_512k_p03 524288 36 ${PROFILE_S:-400} ;;
  *) echo "STEP=${STEP}: unknown (launch2 | attn | third | ti | serve39 | topk40 | profile36)"
     exit 2 ;;
esac
