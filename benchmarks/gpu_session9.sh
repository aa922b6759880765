#!/usr/bin/env bash
# The GPU calls of session 9, one device call each (device tool: carry [".whl"]):
#   STEP=a  issue 13 item 4 / issue 16 item 4: the decode step at 128K, B 64 (fp8_v4 rows, f32
#           attention) timed one Engine.step at a time and pipelined (Engine.decode), both in
#           the same cells, profiled; issue 13's 512K target: HiSparse vs LeanSparse (bf16 and
#           FP8 coarse pass) at 512K, B 32, pipelined, profiled.
#   STEP=b  issue 15: where LeanSparse speculative decoding departs from plain decoding with
#           Triton kernels (scripts/spec_divergence.py, both variants, longer budgets).
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
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
