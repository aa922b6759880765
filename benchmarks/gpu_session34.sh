#!/usr/bin/env bash
# Session 34's GPU calls (device tool, carry [".whl"]); no device was lent in session 34, so
# none of these has run yet.
# STEP=paged (~450 s warm): the paged kernels (device page pools read in place: HiSparse's
#   decode indexer over FP8 keys, index_scores_paged; LeanSparse's coarse pass over PQ codes,
#   pq_topc with a page table, Pallas and jax-triton): their GPU tests and the engine's GPU
#   tests, then benchmarks/pooled_reads_gpu.py (B 8 and 36 x 512K, pages of 64: a gathered
#   copy + the contiguous kernel, as before session 34, against the paged kernels; keys also
#   against the contiguous floor), results under $OUT/paged_bench/.
# STEP=capacity: configs/experiments/capacity_s34.gin at CONTEXTS (default "(524288,)"; then
#   "(972800,)"), one context a call, under $OUT/capacity/capacity_s34/ (copy its results.json
#   to results/capacity_s34/ after each call: the next call resumes from it).
# STEP=scale: configs/experiments/scale_small_batch_s33.gin (512K batches 32 and 64, three
#   blocks a cell; session 33 wrote it, not run yet) under $OUT/scale_small_batch_s33/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-paged}" in
  paged)
    TAIL=30 part gpu_tests ${TESTS_S:-260} "python3 -m pytest -q -m gpu -rA \
      tests/test_kernel_index_scores_paged.py tests/test_kernel_pq_topc_paged.py \
      tests/test_gpu_hierarchy.py::test_pooled_keys_read_in_place_on_gpu \
      tests/test_gpu_hierarchy.py::test_pooled_codes_read_in_place_on_gpu \
      tests/test_gpu_hierarchy.py::test_leansparse_kernels_match_xla_on_gpu"
    TAIL=16 part paged_bench ${BENCH_S:-220} "python3 benchmarks/pooled_reads_gpu.py \
      --coarse jax_triton:fp8,triton:bf16 --out \$OUT" ;;
  capacity) capacity capacity_s34 ;;  # resumes from results/capacity_s34/
  scale)
    RUN=scale_small_batch_s33 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  *) echo "STEP=${STEP}: unknown (paged | capacity | scale)"; exit 2 ;;
esac
