#!/usr/bin/env bash
# The GPU calls of session 7, one device call each (device tool: carry [".whl"]; parts run
# from a branch snapshot in .branches/<part> when one is carried, else from this tree):
#   STEP=a  GPU tests of the kernel top-k in exact selections; 128K prefill (bf16 matmuls) with
#           the exact selections' top-k by "xla" vs "triton" at chunks 4096 / 8192
#           (benchmarks/prefill_precision_gpu.py); the speculative experiment's missing cells
#           (C2, C4, leansparse C8) resumed from results/speculative/results.json.
#   STEP=b  issue 16: benchmarks/kernels_session7_gpu.py (kernel_compare's default config, the
#           kernel GPU tests, the profiled decode step, a pq_topc jax_triton sweep); the
#           speculative experiment's cells still missing after STEP=a, resumed.
#   STEP=c  the kernel GPU tests after the topk fix; the decode step vs its kernels (issue 16
#           item 4); leansparse C8 (speculative, resumed) and leansparse C4 with Triton kernels
#           again; the GLM-5 DSA paging slice (benchmarks/dsa_paging_gpu.py).
#   STEP=d  the decode step vs its kernels with V4's FP8 rows (kv_dtype fp8_v4; STEP=c ran f32
#           rows, where sparse_attention was 58% of the step); leansparse C8 (resumed); leansparse
#           C4 with Triton kernels again (call 1: greedy tokens differed).
# Everything comes back in $OUT/<step>.tar (more files than $OUT returns).
source benchmarks/gpu_lib.sh
STEP=${STEP:-a}
case "$STEP" in
  a)
    part gputests 90 "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model.py"
    part prefill 190 "python3 benchmarks/prefill_precision_gpu.py --contexts 131072 --precisions bf16 --implementations xla,triton --chunks 4096,8192 --out \$OUT"
    part speculative 300 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('resident', 'hisparse', 'leansparse', 'adaptive')\" \"--gin.speculative.concurrencies=(1, 2, 4, 8)\" --gin.speculative.decode_tokens=64 --gin.speculative.time_limit_s=250 --gin.speculative.results_dir=None \"--gin.speculative.resume_from='results/speculative/results.json'\"" ;;
  b)
    part kernels 370 "python3 benchmarks/kernels_session7_gpu.py --out \$OUT/session7 --budget-s 310"
    part speculative 130 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('resident', 'hisparse', 'leansparse', 'adaptive')\" \"--gin.speculative.concurrencies=(1, 2, 4, 8)\" --gin.speculative.decode_tokens=64 --gin.speculative.time_limit_s=80 --gin.speculative.results_dir=None \"--gin.speculative.resume_from='results/speculative/results.json'\""
    part leanxla 60 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('leansparse',)\" \"--gin.speculative.concurrencies=(4,)\" --gin.speculative.decode_tokens=64 --gin.speculative.results_dir=None \"--gin.speculative.implementation='xla'\" \"--gin.run.name='spec_lean_xla'\"" ;;
  c)
    part gputests 120 "python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --timeout 60 tests/test_kernel_topk.py tests/test_kernel_pq_topc.py tests/test_kernel_hot_resolve.py > \$OUT/gputests.log 2>&1; tail -25 \$OUT/gputests.log"
    part decode_profile 160 "python3 benchmarks/decode_profile_gpu.py --out \$OUT --budget-s 150"
    part speculative 80 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('resident', 'hisparse', 'leansparse', 'adaptive')\" \"--gin.speculative.concurrencies=(1, 2, 4, 8)\" --gin.speculative.decode_tokens=64 --gin.speculative.time_limit_s=30 --gin.speculative.results_dir=None \"--gin.speculative.resume_from='results/speculative/results.json'\""
    part leantriton 60 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('leansparse',)\" \"--gin.speculative.concurrencies=(4,)\" --gin.speculative.decode_tokens=64 --gin.speculative.results_dir=None \"--gin.speculative.implementation='triton'\" \"--gin.run.name='spec_lean_triton'\""
    part dsa 110 "python3 benchmarks/dsa_paging_gpu.py --out \$OUT --budget-s 60" ;;
  d)
    part decode_fp8 170 "python3 benchmarks/decode_profile_gpu.py --kv-dtype fp8_v4 --out \$OUT --budget-s 160"
    part speculative 90 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('resident', 'hisparse', 'leansparse', 'adaptive')\" \"--gin.speculative.concurrencies=(1, 2, 4, 8)\" --gin.speculative.decode_tokens=64 --gin.speculative.time_limit_s=30 --gin.speculative.results_dir=None \"--gin.speculative.resume_from='results/speculative/results.json'\""
    part leantriton 110 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('leansparse',)\" \"--gin.speculative.concurrencies=(4,)\" --gin.speculative.decode_tokens=64 --gin.speculative.results_dir=None \"--gin.speculative.implementation='triton'\" \"--gin.run.name='spec_lean_triton'\"" ;;
  *) echo "STEP must be a, b, c or d" >&2; exit 2 ;;
esac
pack "$STEP"
