#!/usr/bin/env bash
# What session 26 left for the next GPU call (device tool, carry [".whl"], ~330 s, one call;
# Nsight Compute needs a Firecracker machine, `uname -r` ending in fc):
# 1. the Mosaic GPU GPU tests, with the row-loop variant (row copies issued by a loop instead
#    of 64 unrolled rows: 43,329 -> 18,544 operations in the kernel's module,
#    benchmarks/mosaic_code_size.py) against the XLA reference;
# 2. kernel_ncu_gpu.sh with the input ablations (two new pq_scores variants: codes per key,
#    codes per subspace) and Nsight Compute, now with shared-memory wavefront and bank-conflict
#    counters, on the pq score kernel with random and with all-zero codes (the 2.4x whose
#    cause is open) and on the Mosaic kernel unrolled and looped (is `no_instruction` the
#    bound?).
# Everything under $OUT comes back in one tar.
source "$(dirname "$0")/gpu_lib.sh"
part mosaic_tests 150 "python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_kernel_sparse_attention.py -k mosaic"
mkdir -p "$OUT/ncu"
OPS="pq_topc pq_topc_zero_codes sparse_attention_mosaic sparse_attention_mosaic_loop" \
  OUT=$OUT/ncu bash "$ROOT/benchmarks/kernel_ncu_gpu.sh" 2>&1 | tail -30
pack session26_next
