#!/usr/bin/env bash
# The GPU calls of session 6, one device call each (device tool: carry [".whl"]):
#   STEP=a   GPU tests of the speculative engine and sparse_attention (greedy-exact on the GPU,
#            v2 f32 path); the speculative experiment on the trained model + drafter
#            (configs/experiments/speculative.gin, time-limited); device pools vs preallocated
#            decode-step timing at 128K (benchmarks/pools_gpu.py, bf16 matmuls).
#   STEP=scale1m  the per-op profile of a 128K prefill with bf16 matmuls, then
#            experiments/scale.py at 1M tokens (bf16 matmuls) into run scale_long
#   STEP=final  one shared call: the parts named in PARTS (default all), each a command run
#            with a timeout from a branch snapshot in .branches/<part> (carried; made with
#            `git archive <branch>`), its output under $OUT/<part>: accuracy (the 200-example
#            study), serving (capacity/loadstep/replay), prefix (streamed admission), kernels
#            (hot_resolve), and prefill (this tree: 128K bf16 prefill at chunks 4096 / 8192).
#            The commands are the helpers' GPU_READY lines, recorded in RESULTS.md.
# Everything comes back in $OUT/<step>.tar (more files than $OUT returns).
source benchmarks/gpu_lib.sh
STEP=${STEP:-a}
case "$STEP" in
  a)
    echo "== gpu tests"; timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_speculative.py tests/test_kernel_sparse_attention.py 2>&1 | tail -15
    echo "== speculative"; timeout 250 python3 -m experiments.cli run \
      configs/experiments/speculative.gin \
      "--gin.speculative.methods=('resident', 'hisparse', 'adaptive', 'leansparse')" \
      "--gin.speculative.concurrencies=(1, 8, 4)" --gin.speculative.decode_tokens=64 \
      --gin.speculative.time_limit_s=200 --gin.speculative.results_dir=None 2>&1 \
      | quiet | tail -25
    echo "== pools"; timeout 150 python3 benchmarks/pools_gpu.py --contexts 131072 \
      --methods resident,leansparse,hisparse,adaptive --codebooks random --warm 2 --steps 8 \
      --precision bf16 --skip-capacity --budget-s 120 --out "$OUT/pools" --tag 128k 2>&1 \
      | quiet | tail -14 ;;
  scale1m)
    echo "== prefill profile (bf16, 128K)"; timeout 100 python3 benchmarks/prefill_profile_gpu.py \
      --context 131072 --precision bf16 --out "$OUT/prefill_profile" 2>&1 | tail -22
    rm -f "$OUT/prefill_profile/prefill_trace.json.gz"
    mkdir -p "$OUT/scale_long" && cp results/scale_long/results.json "$OUT/scale_long/"
    timeout "${SCALE_TIMEOUT:-540}" python3 -m experiments.cli run configs/experiments/scale.gin \
      "--gin.scale.implementation='triton'" "--gin.scale.contexts=(1048576,)" \
      "--gin.scale.batches=${SCALE_BATCHES:-(1,)}" "--gin.run.name='scale_long'" \
      "--gin.model_preset.matmul_precision='bf16'" 2>&1 | quiet | tail -24 ;;
  final)
    part kernels 45 "python3 benchmarks/kernels_session6_gpu.py --out \$OUT --budget-s 36 --cells hot_resolve,nosync"
    part prefill 45 "python3 benchmarks/prefill_precision_gpu.py --contexts 131072 --precisions bf16 --chunks 4096 --out \$OUT"
    part prefix 65 "python3 benchmarks/prefill_host_gpu.py --quick --contexts 131072 --methods leansparse,hisparse,adaptive --budget-s 52 --out \$OUT/prefill_host"
    part accuracy 178 "mkdir -p checkpoints && cp -r \$ROOT/checkpoints/long checkpoints/ && STEP=accuracy TASKS=\"('niah',)\" METHODS=\"('resident','leansparse_C64','leansparse_C128','direct_pq')\" EXAMPLES=200 SLOTS=100 LENGTHS='(1024,2048,4096,8192,16384)' ACC_TIMEOUT=170 bash benchmarks/train_long_gpu.sh; rm -f \$OUT/jaxcache.tar"
    part serving 250 "STEP=session bash benchmarks/serving_gpu.sh" ;;
esac
pack "$STEP"
