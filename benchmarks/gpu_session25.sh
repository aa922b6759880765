#!/usr/bin/env bash
# What session 25 left for the next GPU call (device tool, carry [".whl"], ~150 s, one call):
# 1. the state-in-place GPU test (tests/test_state_in_place.py: does the runtime keep every
#    state buffer, the pinned_host pools included, in place from the engine's first step?
#    the hypothesis behind the 1M batch-64 failure, issue 13);
# 2. Nsight Compute on the Mosaic GPU sparse_attention kernel (issue 16: the one kernel whose
#    bound is unmeasured), through kernel_ncu_gpu.sh with OPS=sparse_attention_mosaic ABLATE=0.
# Everything under $OUT comes back in one tar.
source "$(dirname "$0")/gpu_lib.sh"
part in_place 150 "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_state_in_place.py"
mkdir -p "$OUT/ncu_mosaic"
OPS=sparse_attention_mosaic ABLATE=0 OUT=$OUT/ncu_mosaic bash "$ROOT/benchmarks/kernel_ncu_gpu.sh" \
  2>&1 | tail -12
pack session25_next
