#!/usr/bin/env bash
# What session 30 (no GPU lent) left for the next GPU calls (device tool, carry [".whl"]);
# everything under $OUT comes back in one tar.
# Session 30 removed LeanSparse's XLA sorts from the decode step (session 29's H200 profile at
# 128K: 10 sort kernels a step, ~0.2 ms at batch 1 and at batch 8): the miss filter is one
# kernel (the new ``miss_filter`` op: s_(k), statistics, threshold), the rerank goes through
# the new ``candidate_topk`` op (pallas_kernels/topk/candidates.py, one program a row, radix
# selection in registers), pq_topc's jax-triton top-C takes topk "triton_fused" (its sample
# floor in-kernel, no XLA lax.top_k), and the key cache's membership bitmap is a unique-index
# scatter.
# STEP=check (default; ~420 s, one call):
#   1. tests: candidate_topk's and miss_filter's GPU tests, the LeanSparse decode step
#      against XLA with the kernels (all three coarse passes), pq_topc's jax-triton tests
#      (their top-C changed), and HiSparse's decode step with the engine's "mosaic" family
#      (Mosaic attention);
#   2. benchmarks/candidate_topk_gpu.py: the kernel's launch variants (warps, lanes) against
#      the XLA sorts it replaces, B 1 / 8 / 64, R 2048 / 2112, k 512, and the miss_filter op
#      (xla vs its one kernel);
#   3. kernel_compare pq_topc at B 64, N 131072: jax_triton (top-C by topk "triton_fused")
#      vs jax_triton_sample_topk (session 29's path);
#   4. hot_resolve_phases_gpu.py at batch 1 with the small and the decode-sized (32768) map
#      scratch, both launch forms profiled: why the decode step's hot_resolve_front takes
#      54-57 us a call at batch 1 when map + control take ~25 us in the phases run (and
#      apply ~45 us against ~24: a 2 GiB pool, his_b1_bigpool, tests the host side).
# STEP=profile (~330 s, one call): the decode profile at 128K, batch 1 and 8, HiSparse and
#   leansparse_fp8_jt, with the HLO census of the step's sorts and scatters
#   (decode_profile_gpu.py --hlo-census): did the sorts go, and which are left.
# STEP=scale (~520 s, one call): 512K at batches 1, 8, 32, 64 after the change
#   (configs/experiments/scale_small_batch_s30.gin; 32 / 64 were not re-run after session 29's
#   hot_resolve change either), stopped by its 480 s budget; resumable (results.json after
#   every cell). Copy $OUT/scale_small_batch_s30/ into results/scale_small_batch_s30/ and
#   regenerate the README table (experiments.scale_report).
source "$(dirname "$0")/gpu_lib.sh"
profile() {  # profile NAME BATCH: decode_profile at 128K for HiSparse and leansparse_fp8_jt
  TAIL=60 part "$1" 170 "python3 benchmarks/decode_profile_gpu.py \
    --methods hisparse,leansparse_fp8_jt --context 131072 --batch $2 --hlo-census \
    --gin \"model_preset.matmul_precision='bf16'\" --prefill-cache /tmp/lsparse_scale_prefill \
    --out \$OUT --budget-s 160"
}
case "${STEP:-check}" in
  check)
    part tests 150 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_candidate_topk.py tests/test_kernel_miss_filter.py \
      tests/test_gpu_hierarchy.py tests/test_kernels_map.py tests/test_kernel_pq_topc.py \
      -k 'candidate or miss_filter or leansparse_kernels or jax_triton or mosaic'"
    TAIL=30 part ctk 90 "python3 benchmarks/candidate_topk_gpu.py --out \$OUT"
    TAIL=8 part kc 80 "python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      \"--gin.kernel_compare.ops=('pq_topc',)\" \"--gin.kernel_compare.batches=(64,)\" \
      \"--gin.kernel_compare.histories=(131072,)\" \
      \"--gin.kernel_compare.implementations=('jax_triton','jax_triton_sample_topk')\" \
      --gin.kernel_compare.budget_s=60 \"--gin.run.name='kernel_compare_session30'\""
    TAIL=12 part phases 120 "python3 benchmarks/hot_resolve_phases_gpu.py --quick \
      --cases his_b1,his_b1_wide,his_b1_bigpool,key_b1,key_b1_wide --out \$OUT"
    pack session30_check ;;
  profile)
    profile b1 1
    profile b8 8
    pack session30_profile ;;
  scale)
    RUN=scale_small_batch_s30 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  *) echo "STEP=${STEP}: unknown (check | profile | scale)"; exit 2 ;;
esac
