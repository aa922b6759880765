#!/usr/bin/env bash
# The GPU calls of session 9, one device call each (device tool: carry [".whl"]):
#   STEP=a  issue 13 item 4 / issue 16 item 4: the decode step at 128K, B 64 (fp8_v4 rows, f32
#           attention) timed one Engine.step at a time and pipelined (Engine.decode), both in
#           the same cells, profiled; issue 13's 512K target: HiSparse vs LeanSparse (bf16 and
#           FP8 coarse pass) at 512K, B 32, pipelined, profiled.
#   STEP=b  issue 15: where LeanSparse speculative decoding departs from plain decoding with
#           Triton kernels (scripts/spec_divergence.py, both variants, longer budgets).
#   (between b and c: spec_divergence --variant scores_check and
#    benchmarks/index_scores_probe_gpu.py found the Triton index_scores wrong at B > 1 when C
#    is not a multiple of its block; fixed by padding C)
#   STEP=c  after the fix: the index_scores GPU tests, the probe, spec_divergence as-is, the
#           LeanSparse C4 speculative cell with Triton kernels, and LeanSparse's decode step at
#           128K, B 64 (the padding's cost).
# Everything comes back in $OUT/<step>.tar (more files than $OUT returns).
source benchmarks/gpu_lib.sh
STEP=${STEP:-a}
case "$STEP" in
  a)
    part prof128 290 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse --kv-dtype fp8_v4 --attention-precision f32 --time-both --out \$OUT --budget-s 280"
    part prof512 290 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse_fp8,leansparse --context 524288 --batch 32 --steps 8 --kv-dtype fp8_v4 --attention-precision f32 --out \$OUT --budget-s 280" ;;
  b)
    part specdiv 280 "python3 scripts/spec_divergence.py --variant none --time-limit 270"
    part specdiv_scores 280 "python3 scripts/spec_divergence.py --variant scores_xla --time-limit 270" ;;
  c)
    part kerneltests 120 "python3 -m pytest -q -m gpu tests/test_kernel_index_scores.py -p no:cacheprovider"
    part probe 60 "python3 benchmarks/index_scores_probe_gpu.py"
    part specdiv 170 "python3 scripts/spec_divergence.py --variant none --time-limit 120"
    part leantriton 110 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('leansparse',)\" \"--gin.speculative.concurrencies=(4,)\" --gin.speculative.decode_tokens=64 --gin.speculative.results_dir=None \"--gin.speculative.implementation='triton'\" \"--gin.run.name='spec_lean_triton'\""
    part prof128 190 "python3 benchmarks/decode_profile_gpu.py --methods leansparse --kv-dtype fp8_v4 --attention-precision f32 --time-both --out \$OUT --budget-s 180" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
