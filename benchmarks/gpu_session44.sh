#!/usr/bin/env bash
# Session 44's GPU calls (device tool, carry [".whl"]); the card (H100 or H200) is printed
# first and named in benchmarks/RESULTS.md:
# STEP=a (~450 s): kernel_compare_s42_index.gin (index_scores at B 64, C 2048 with its
#   query quantized in-kernel, + top-512 split / fused, candidate_topk's default now "flat1")
#   -> $OUT/kc/; candidate_topk's radix-search forms at B 64 (R 2048 / 2112, k 512; "blocks":
#   the [NBLK, BC, 4] count a step, "flat1" / "flat2": 1D counts, 1 or 2 bits a step) ->
#   $OUT/ct/; then per-instruction warp-stall sampling (kernel_ncu_gpu.sh SOURCE=1) of
#   sparse_attention v2 and index_scores' split top-512 (score kernel + candidate_topk) ->
#   $OUT/sa/, $OUT/it/; then launch_variants_gpu.py --set s44 (sparse_attention with one
#   warpgroup a program, 15 rounds) -> $OUT/lv/.
# STEP=b (~380 s): the GPU tests of the kernels changed in session 44 (candidate_topk, the
#   miss filter, index_scores / index_scores_paged / index_topk with in-kernel fp8 query
#   quantization) -> $OUT/gputests/; then the 512K batch-36 fp8 decode profile of hisparse
#   and leansparse_fp8_jt (as gpu_session43.sh STEP=profiles' first part) -> $OUT/p512/.
# STEP=c (~200 s): after the key search's early stop (candidates.radix_search_scalar
#   stop_at_m): candidate_topk's GPU tests, kernel_compare_s42_index.gin again -> $OUT/kc/,
#   candidate_topk blocks vs flat1 (8 warps) -> $OUT/ct/.
# (The forms "blocks" / "flat1" / "flat2" that STEP a and c compared as candidate_topk_gpu.py
# variants were removed once flat1 won; the steps now time the kernel as it is.)
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-a}" in
  a)
    TAIL=30 part kc ${KC_S:-170} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s42_index.gin 2>&1 | grep -v ' spent$'"
    TAIL=30 part ct ${CT_S:-110} "python3 benchmarks/candidate_topk_gpu.py --batches 64 \
      --out \$OUT --variants '${CT_VARIANTS:-xla,triton nw 8 bc 256,triton nw 4 bc 256}'"
    (OUT=$OUT/sa SOURCE=1 ABLATE=0 LAUNCHES=1 SAMPLING=auto OPS=sparse_attention \
      bash benchmarks/kernel_ncu_gpu.sh 2>&1 | tail -32)
    (OUT=$OUT/it SOURCE=1 ABLATE=0 LAUNCHES=2 OPS=index_top512 \
      bash benchmarks/kernel_ncu_gpu.sh 2>&1 | tail -40)
    variants lv s44 15 ${LV_S:-120} ;;
  b)
    TAIL=8 part gputests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_candidate_topk.py tests/test_kernel_miss_filter.py \
      tests/test_kernel_index_scores.py tests/test_kernel_index_scores_paged.py"
    PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-220} ;;
  c)
    TAIL=8 part gputests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_candidate_topk.py tests/test_kernel_index_scores.py -k 'topk or top_k'"
    TAIL=30 part kc ${KC_S:-120} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s42_index.gin 2>&1 | grep -v ' spent$'"
    TAIL=16 part ct ${CT_S:-90} "python3 benchmarks/candidate_topk_gpu.py --batches 64 \
      --out \$OUT --variants 'triton nw 8 bc 256'" ;;
  *) echo "STEP=${STEP}: unknown (a | b | c)"; exit 2 ;;
esac
