#!/usr/bin/env bash
# Session 27's GPU call (device tool, carry [".whl"], ~300 s): the jax-triton pq score
# kernel's bank swizzle (issue 16; pallas_kernels/pq_topc/jax_triton.py's docstring):
#   1. its GPU tests with each gather lowering (smem = swizzled, smem_linear, shuffle);
#   2. the score kernel alone at B 64, N 131072: swizzled vs row-major vs shuffle, random and
#      all-zero codes, bf16 and fp8 books (kernel_ablation_gpu.py --only pq_scores);
#   3. Nsight Compute on pq_topc with the swizzled and the row-major book (bank conflicts per
#      shared load; Firecracker machines only).
# Then the scale cells: RUN=scale_lean_jt_swizzle STEP=scale bash benchmarks/gpu_scale_batch.sh
source "$(dirname "$0")/gpu_lib.sh"
part pq_tests 150 "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_pq_topc.py \
  -k jax_triton"
part pq_ablation 150 "python3 benchmarks/kernel_ablation_gpu.py --only pq_scores \
  --out \$OUT --budget-s 100 --rounds 3"
mkdir -p "$OUT/ncu"
OPS="pq_topc pq_topc_linear" ABLATE=0 NCU_S=100 OUT=$OUT/ncu \
  bash "$ROOT/benchmarks/kernel_ncu_gpu.sh" 2>&1 | tail -12
pack session27_swizzle
