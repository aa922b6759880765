#!/usr/bin/env bash
# Prepared in session 17 for the next GPU session (device tool, carry [".whl"]), one call per
# STEP; every part is time-limited. Session 18 ran a (spec_f32 cut by its limit), e, c and d;
# b has not run. SPEC_S sets each spec part's limit (default 140 s; f32 with Triton needs more).
#   STEP=a  issue 15: where speculative_v4.gin's greedy tokens depart from plain decoding
#           (hisparse C8; records first_divergence and the plain logit gap there: a gap
#           near 0 is a rounding flip of a near tie, a large one a real departure), three
#           ways: bf16 matmuls (as committed), f32 matmuls, and f32 matmuls with every op in
#           XLA (no Triton kernel: plain decode and verification then attend through the same
#           XLA code). bf16 departs and f32 does not: bf16 GEMM rounding differs between a
#           T = 1 step and a T = 5 verification. f32 with Triton departs and f32 XLA does not:
#           the decode step's Triton attention (3-pass TF32) vs verification's XLA attention.
#   STEP=b  issue 13's 512K target (LeanSparse <= 0.85x HiSparse's step) with trained-like
#           reuse: the decode step at 512K, B 32, driven by RepeatInputs(p = 0.3) (reuse ~0.23,
#           session 13), hisparse vs leansparse with the jax-triton FP8 coarse pass, pipelined,
#           profiled (session 10: 0.895 with random inputs, ~1% reuse); then where LeanSparse's
#           continuation admission spends its time on the GPU (benchmarks/prefix_admit.py).
#   STEP=c  issue 14: capacity at 512K with p = 0.3 (resumes results/capacity_p0.3_jt).
#   STEP=d  the same at 950K.
#   STEP=e  issue 15's memory-capped cells (serve_capped.gin) with the drafter's feature ring
#           (serve.drafter_ring='features': 131,584 B instead of 524,800 B a request, the same
#           weights): hisparse plain, hisparse and adaptive with the drafter; then issue 16's
#           topk with the select chunk's prefix count in row scans (scan_rows 8 / 32 / 128,
#           fused.py) beside the default, per kernel, and its GPU tests.
#   STEP=f  ModelConfig.weight_dtype='bf16' (the matmul weights stored bf16: half the weight
#           bytes a step): its GPU equality test, then the 128K B 64 decode step with f32 and
#           with bf16 weights (session 14's profile: gemm 2.74 of 8.55 ms reads f32 weights).
# Results come back as $OUT/<STEP>.tar.
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-a}
JT="--gin \"LeanSparseConfig.coarse_implementation='jax_triton'\""
case "$STEP" in
  a)
    spec spec_bf16 bf16 triton
    spec spec_f32 highest triton
    spec spec_f32_xla highest xla ;;
  b)
    part jt512_p03 280 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse_fp8 \
      --context 524288 --batch 32 --steps 8 --kv-dtype fp8_v4 --attention-precision f32 \
      --input-repeat 0.3 $JT --out \$OUT --budget-s 270"
    part prefix_admit 200 "python3 benchmarks/prefix_admit.py --preset v4_flash --prefix 131072 \
      --suffix 2048 --chunk 4096 --page 64 --implementation triton --repeats 2 --out \$OUT" ;;
  c|d)
    ctx=524288; [ "$STEP" = c ] || ctx=972800
    part capacity 560 "PRIOR=$ROOT/results LIMIT=540 CONTEXTS=\"($ctx,)\" \
      RUN_NAME=capacity_p0.3_jt STEP=capacity bash benchmarks/serving_gpu.sh \
      --gin.capacity.input_repeat=0.3 \
      \"--gin.LeanSparseConfig.coarse_implementation='jax_triton'\" \
      \"--gin.LeanSparseConfig.coarse_precision='fp8'\"" ;;
  e)
    TAIL=16 part capped_features 300 "python3 -m experiments.cli run configs/experiments/serve_capped.gin \
      \"--gin.serve.method='hisparse'\" \"--gin.run.name='capped_hisparse'\" 2>&1 | tail -3
      for m in hisparse adaptive; do python3 -m experiments.cli run configs/experiments/serve_capped.gin \
        \"--gin.serve.method='\$m'\" \"--gin.serve.drafter_checkpoint='checkpoints/drafter_small'\" \
        \"--gin.serve.drafter_ring='features'\" \"--gin.run.name='capped_\${m}_spec_features'\" \
        2>&1 | tail -3; done"
    TAIL=8 part topk_rows 120 "python3 benchmarks/topk_launch_gpu.py --out \$OUT --budget-s 60 \
      --sweep r8,r32,r128 && python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py -k 'fused_on_gpu and (r32 or default)'" ;;
  f)  # ModelConfig.weight_dtype='bf16' (built in session 18, not run): equality on the GPU,
      # then the 128K B64 decode step with f32 and with bf16-stored weights (bf16 matmuls)
    TAIL=6 part bf16_weights_test 90 "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_gpu_hierarchy.py -k bf16_stored"
    for w in f32 bf16; do
      part profile_w$w 200 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse \
        --context 131072 --batch 64 --steps 8 --kv-dtype fp8_v4 \
        --gin \"model_preset.weight_dtype='$w'\" --out \$OUT --budget-s 190"
    done ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
