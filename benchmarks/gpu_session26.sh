#!/usr/bin/env bash
# What session 26 left for the next GPU calls (device tool, carry [".whl"]); everything under
# $OUT comes back in one tar.
# STEP=ncu (default; ~330 s, one call; Nsight Compute needs a Firecracker machine, `uname -r`
# ending in fc):
#   1. the Mosaic GPU tests, with the row-loop variant (row copies issued by a loop instead of
#      64 unrolled rows: 43,329 -> 18,544 operations in the kernel's module,
#      benchmarks/mosaic_code_size.py) against the XLA reference;
#   2. kernel_ncu_gpu.sh with the input ablations (two new pq_scores variants: codes per key,
#      codes per subspace) and Nsight Compute, now with shared-memory wavefront and
#      bank-conflict counters, on the pq score kernel with random and with all-zero codes (the
#      2.4x whose cause is open) and on the Mosaic kernel unrolled and looped (is
#      `no_instruction` the bound?).
# STEP=index_logits (~400 s, one call): the prefill's indexer scores through the new
#   index_logits kernel (issue 13): its GPU test, kernel vs XLA twin at a V4 prefill tile
#   (benchmarks/index_logits_gpu.py), and a 128K bf16 prefill profile with the kernels
#   (`--implementation triton`) and without (`xla`): GPU ms per chunk at the end.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-ncu}" in
  index_logits)
    part il_test 120 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_index_logits.py"
    part il_bench 200 "python3 benchmarks/index_logits_gpu.py --out \$OUT --budget-s 150"
    for impl in triton xla; do
      TAIL=12 part "prefill_$impl" 150 "python3 benchmarks/prefill_profile_gpu.py \
        --context 131072 --precision bf16 --implementation $impl --out \$OUT"
    done
    pack session26_index_logits ;;
  ncu)
    part mosaic_tests 150 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_sparse_attention.py -k mosaic"
    mkdir -p "$OUT/ncu"
    OPS="pq_topc pq_topc_zero_codes sparse_attention_mosaic sparse_attention_mosaic_unrolled" \
      OUT=$OUT/ncu bash "$ROOT/benchmarks/kernel_ncu_gpu.sh" 2>&1 | tail -30
    pack session26_next ;;
  *) echo "STEP=${STEP}: unknown (ncu | index_logits)"; exit 2 ;;
esac
