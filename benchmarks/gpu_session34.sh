#!/usr/bin/env bash
# Session 34's GPU calls (device tool, carry [".whl"]); no device was lent in session 34, so
# none of these has run yet.
# STEP=paged (~400 s warm): the paged index_scores kernel (HiSparse's decode indexer reading
#   FP8 keys in place from device page pools): its GPU tests and the engine's GPU tests with
#   device pools, then benchmarks/index_scores_paged_gpu.py (B 8 and 36 x N 131104, pages of
#   64: gather + contiguous kernel, as before, against the paged kernel, and the contiguous
#   floor), results under $OUT/paged_bench/.
# STEP=capacity: configs/experiments/capacity_s34.gin at CONTEXTS (default "(524288,)"; then
#   "(972800,)"), one context a call, under $OUT/capacity/capacity_s34/ (copy its results.json
#   to results/capacity_s34/ after each call: the next call resumes from it).
# STEP=scale: configs/experiments/scale_small_batch_s33.gin (512K batches 32 and 64, three
#   blocks a cell; session 33 wrote it, not run yet) under $OUT/scale_small_batch_s33/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-paged}" in
  paged)
    TAIL=30 part gpu_tests ${TESTS_S:-200} "python3 -m pytest -q -m gpu -rA \
      tests/test_kernel_index_scores_paged.py tests/test_kernel_index_scores.py \
      tests/test_gpu_hierarchy.py"
    TAIL=12 part paged_bench ${BENCH_S:-180} "python3 benchmarks/index_scores_paged_gpu.py \
      --out \$OUT" ;;
  capacity)  # resumes the cells of an earlier call copied to results/capacity_s34/
    mkdir -p "$OUT/capacity/capacity_s34"
    [ -f results/capacity_s34/results.json ] && cp results/capacity_s34/results.json \
      "$OUT/capacity/capacity_s34/"
    TAIL=40 part capacity ${CAPACITY_S:-560} "python3 -m experiments.cli run \
      configs/experiments/capacity_s34.gin \
      \"--gin.capacity.time_contexts=${CONTEXTS:-(524288,)}\"" ;;
  scale)
    RUN=scale_small_batch_s33 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  *) echo "STEP=${STEP}: unknown (paged | capacity | scale)"; exit 2 ;;
esac
