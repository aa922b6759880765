#!/usr/bin/env bash
# Prepared in session 19 for the next GPU session (device tool, carry [".whl"]), one call per
# STEP; every part is time-limited. Results come back as $OUT/<STEP>.tar.
#   STEP=a  issue 14: the mixed iteration (serving.mixed, built in session 19) against the
#           decode step and a prefill chunk as two programs (benchmarks/mixed_step.py: V4-Flash
#           slice, 32K context, batch 16, 4096-token chunk, resident / hisparse / leansparse);
#           then issue 15: speculative_v4.gin's hisparse C8 with bf16 matmuls again, now that
#           verification blocks attend through the sparse_attention kernel as plain decode
#           does (blocks.KERNEL_QUERIES): session 18 saw 2 of 504 tokens depart at near ties
#           with verification in XLA's attention. Still departing: bf16 GEMM rounding of a
#           T = 5 block vs a T = 1 step (or the kernel's row order: ring vs banded window).
#           Then the small model's greedy-exact GPU test with the Triton kernels in plain
#           steps and verification alike (4 methods).
#   STEP=b  issue 15: the same with f32 matmuls (SPEC_S, default 450 s: f32 with Triton is slow).
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-a}
case "$STEP" in
  a)
    TAIL=6 part mixed 240 "python3 benchmarks/mixed_step.py --preset v4_flash --context 32768 \
      --batch 16 --chunk 4096 --page 64 --implementation triton --out \$OUT"
    spec spec_bf16_kernel bf16 triton 160
    TAIL=6 part spec_gpu_tests 150 "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_speculative.py -k 'on_gpu and triton'" ;;
  b)
    spec spec_f32_kernel highest triton "${SPEC_S:-450}" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
