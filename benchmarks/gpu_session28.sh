#!/usr/bin/env bash
# What session 27 left for the next GPU calls (device tool, carry [".whl"]); everything under
# $OUT comes back in one tar.
# STEP=check (default; ~400 s, one call):
#   1. the kernels' GPU tests: pq_topc (the fp8 twin now rounds behind an optimization barrier;
#      its top-C compared up to swaps at the boundary; the swizzle bit for bit; every decode,
#      smem_lanes included, against XLA), index_scores (its fp8 twin likewise),
#      sparse_attention (Mosaic's row loop now the default), index_logits (4 queries a
#      program now the default);
#   2. LeanSparse's decode step with each coarse pass (Pallas bf16, jax-triton bf16 and fp8:
#      the scale study's leansparse_fp8_jt) against XLA (test_gpu_hierarchy.py), the gate
#      before the fp8 jax-triton pass can be LeanSparse's GPU default.
# STEP=kernels (~400 s, one call):
#   1. the pq score kernel's ablation (kernel_ablation_gpu.py --only): swizzled, row-major,
#      smem_lanes (codes one a thread: lane l at word l, no conflict) and 512-key tiles,
#      bf16 and fp8;
#   2. kernel_compare's pq_topc at the target shape (B 64, N 131072): the whole op (score
#      kernel + top-C) with the swizzled book, the row-major one, the Pallas kernels and XLA
#      (issue 16, deliver 5: one H200 run per variant).
# Then: RUN=scale_lean_jt_swizzle STEP=scale bash benchmarks/gpu_scale_batch.sh (README's
# next-GPU list, command 2).
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-check}" in
  check)
    part tests 240 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_kernel_pq_topc.py tests/test_kernel_index_scores.py \
      tests/test_kernel_sparse_attention.py tests/test_kernel_index_logits.py"
    part engine_lean 150 "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_gpu_hierarchy.py -k leansparse_kernels"
    pack session28_check ;;
  kernels)
    part pq_ablation 220 "python3 benchmarks/kernel_ablation_gpu.py \
      --only 'pq_scores N=131072' --out \$OUT --budget-s 170 --rounds 3"
    TAIL=12 part kc_pq 170 "python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      \"--gin.kernel_compare.ops=('pq_topc',)\" \"--gin.kernel_compare.batches=(64,)\" \
      \"--gin.kernel_compare.histories=(131072,)\" \
      \"--gin.kernel_compare.implementations=('xla','triton','jax_triton','jax_triton_linear')\" \
      --gin.kernel_compare.budget_s=140 \"--gin.run.name='kernel_compare_pq'\""
    pack session28_kernels ;;
  *) echo "STEP=${STEP}: unknown (check | kernels)"; exit 2 ;;
esac
