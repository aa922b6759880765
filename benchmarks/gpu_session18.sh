#!/usr/bin/env bash
# Prepared in session 17 for the next GPU session (device tool, carry [".whl"]), one call per
# STEP; every part is time-limited. None of these has run yet.
#   STEP=a  issue 15: where speculative_v4.gin's greedy tokens depart from plain decoding
#           (hisparse C8, bf16 and f32 matmuls; records first_divergence), then issue 13's 512K
#           target (LeanSparse <= 0.85x HiSparse's step) with trained-like reuse: the decode
#           step at 512K, B 32, driven by RepeatInputs(p = 0.3) (reuse ~0.23, session 13),
#           hisparse vs leansparse with the jax-triton FP8 coarse pass, pipelined, profiled.
#           Session 10 measured 0.895 there with random inputs (~1% reuse), the key cache's
#           resolve ~1.3 ms of LeanSparse's step.
#   STEP=b  issue 14: capacity at 512K with p = 0.3 (resumes results/capacity_p0.3_jt).
#   STEP=c  the same at 950K.
# Results come back as $OUT/<STEP>.tar.
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-a}
JT="--gin \"LeanSparseConfig.coarse_implementation='jax_triton'\""
case "$STEP" in
  a)
    for prec in bf16 highest; do
      name=spec_bf16; [ "$prec" = bf16 ] || name=spec_f32
      TAIL=4 part $name 140 "python3 -m experiments.cli run configs/experiments/speculative_v4.gin \
        \"--gin.speculative.methods=('hisparse',)\" \"--gin.model_preset.matmul_precision='$prec'\" \
        --gin.speculative.results_dir=None \"--gin.run.name='$name'\""
    done
    part jt512_p03 270 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse_fp8 \
      --context 524288 --batch 32 --steps 8 --kv-dtype fp8_v4 --attention-precision f32 \
      --input-repeat 0.3 $JT --out \$OUT --budget-s 260" ;;
  b|c)
    ctx=524288; [ "$STEP" = b ] || ctx=972800
    part capacity 560 "PRIOR=$ROOT/results LIMIT=540 CONTEXTS=\"($ctx,)\" \
      RUN_NAME=capacity_p0.3_jt STEP=capacity bash benchmarks/serving_gpu.sh \
      --gin.capacity.input_repeat=0.3 \
      \"--gin.LeanSparseConfig.coarse_implementation='jax_triton'\" \
      \"--gin.LeanSparseConfig.coarse_precision='fp8'\"" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
