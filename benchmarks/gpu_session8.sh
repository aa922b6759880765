#!/usr/bin/env bash
# The GPU calls of session 8, one device call each (device tool: carry [".whl"]):
#   STEP=a  issue 13/16: the decode attention's f32 chunking and bf16 / FP8-in-place paths,
#           then the decode step (benchmarks/attention_precision_gpu.py); issue 15: where
#           LeanSparse speculative decoding departs from plain decoding with Triton kernels
#           (scripts/spec_divergence.py, as-is and with exact rescoring in XLA); the GLM-5 DSA
#           paging slice (benchmarks/dsa_paging_gpu.py).
#   STEP=b  issue 15: spec_divergence and the LeanSparse C4 speculative cell with Triton kernels
#           after the index_scores hi/lo split; issue 13/16: the attention variants in place and
#           the decode step at 128K, B 64 (fp8_v4 rows, f32 attention after the 4-warp fix).
#   STEP=c  issue 17: the NIAH half of the 200-example accuracy study (resumable); issue 13: the
#           LeanSparse decode step at 128K, B 64 after the attention fix; issue 16: pq_topc fp8.
#   STEP=d  (right after c, on the warm machine: its runs/jaxcache holds c's compiles) the NIAH
#           study resumed from results/accuracy_long; issue 14's serving session (capacity,
#           loadstep, replay at one-call scale: benchmarks/serving_gpu.sh STEP=session).
# Everything comes back in $OUT/<step>.tar (more files than $OUT returns).
source benchmarks/gpu_lib.sh
STEP=${STEP:-a}
case "$STEP" in
  a)
    part attn 165 "python3 benchmarks/attention_precision_gpu.py --out \$OUT --budget-s 150"
    part specdiv 115 "python3 scripts/spec_divergence.py --variant none --time-limit 105"
    part specdiv_scores 100 "python3 scripts/spec_divergence.py --variant scores_xla --time-limit 90"
    part dsa 100 "python3 benchmarks/dsa_paging_gpu.py --out \$OUT --budget-s 60" ;;
  b)
    part specdiv 150 "python3 scripts/spec_divergence.py --variant none --time-limit 140"
    part leantriton 90 "python3 -m experiments.cli run configs/experiments/speculative.gin \"--gin.speculative.methods=('leansparse',)\" \"--gin.speculative.concurrencies=(4,)\" --gin.speculative.decode_tokens=64 --gin.speculative.results_dir=None \"--gin.speculative.implementation='triton'\" \"--gin.run.name='spec_lean_triton'\""
    part attn 265 "python3 benchmarks/attention_precision_gpu.py --out \$OUT --budget-s 255 --op-budget-s 75 --decode hisparse+leansparse:fp8_v4:f32" ;;
  c)
    part acc 200 "STEP=accuracy TASKS=\"('niah',)\" ACC_SECONDS=150 ACC_TIMEOUT=195 bash benchmarks/train_long_gpu.sh; rm -f \$OUT/jaxcache.tar"
    part leandecode 185 "python3 benchmarks/decode_profile_gpu.py --methods leansparse --kv-dtype fp8_v4 --attention-precision f32 --out \$OUT --budget-s 170"
    part pqfp8 125 "python3 benchmarks/pq_fp8_gpu.py --out \$OUT --budget-s 110" ;;
  d)
    part acc ${ACC_PART_S:-215} "STEP=accuracy TASKS=\"('niah',)\" ACC_SECONDS=${ACC_S:-170} ACC_TIMEOUT=${ACC_T:-210} bash benchmarks/train_long_gpu.sh; rm -f \$OUT/jaxcache.tar"
    part serving 260 "STEP=session bash benchmarks/serving_gpu.sh" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
