#!/usr/bin/env bash
# The next GPU calls after session 11 (device tool, carry [".whl"]), one call per STEP; every
# part is time-limited and its experiment rewrites results.json after every cell.
#   STEP=reuse     issue 14's selection realism: HiSparse at 200K, B 8, decode driven by
#                  workloads.RepeatInputs(p) for p in $PS (default "0.5 0.8 0.9 0.95"): the
#                  step-to-step reuse each p gives at V4 shapes (the scale experiment records
#                  `reuse` per cell). Pick the p whose reuse matches the trained model's
#                  (results/reuse_trained/: CPU, checkpoints/long: 0.245 / 0.225 / 0.205 at
#                  4K / 8K / 16K; random weights 0.010) and pass it as P below.
#   STEP=capacity  capacity at 200K / 512K / 950K (CONTEXTS, one per call) with
#                  capacity.input_repeat=$P and LeanSparse's jax-triton FP8 coarse pass, into a
#                  new run name (capacity_p<P>_jt) so session 11's random-input table stays.
#   STEP=profile   where a step's time goes at HiSparse's N at 200K (B 76) with that reuse:
#                  benchmarks/decode_profile_gpu.py, hisparse and leansparse_fp8 with the
#                  jax-triton coarse pass (the capacity table's step_fit says the slice's step
#                  is ~0.15 ms per request plus ~1 ms: the profile splits the per-request part).
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-reuse}
case "$STEP" in
  reuse)
    for p in ${PS:-0.5 0.8 0.9 0.95}; do
      part "reuse_$p" 150 "python3 -m experiments.cli run configs/experiments/scale.gin \
        --gin.scale.contexts='(204800,)' --gin.scale.batches='(8,)' \
        \"--gin.scale.methods=('hisparse',)\" --gin.scale.input_repeat=$p --gin.scale.steps=16 \
        --gin.model_preset.kv_dtype=\"'fp8_v4'\" --gin.model_preset.matmul_precision=\"'bf16'\" \
        --gin.scale.implementation=\"'triton'\" --gin.scale.prefill_cache=\"'/tmp/prefills'\" \
        \"--gin.run.name='reuse_p$p'\""
    done ;;
  capacity)
    : "${P:?set P, the input_repeat that matches the trained model reuse (STEP=reuse)}"
    part capacity 560 "PRIOR=$ROOT/results LIMIT=540 CONTEXTS=\"${CONTEXTS:-(204800,)}\" \
      RUN_NAME=capacity_p${P}_jt STEP=capacity bash benchmarks/serving_gpu.sh \
      --gin.capacity.input_repeat=$P \
      \"--gin.LeanSparseConfig.coarse_implementation='jax_triton'\" \
      \"--gin.LeanSparseConfig.coarse_precision='fp8'\"" ;;
  profile)
    : "${P:?set P (STEP=reuse)}"
    part profile 560 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse_fp8 \
      --context 204800 --batch 76 --steps 8 --kv-dtype fp8_v4 --attention-precision f32 \
      --input-repeat $P --gin \"LeanSparseConfig.coarse_implementation='jax_triton'\" \
      --out \$OUT --budget-s 540" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
