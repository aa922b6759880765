#!/usr/bin/env bash
# Prepared at the end of session 9 for the next GPU session, one device call each (device tool:
# carry [".whl"]); none of these has run yet.
#   STEP=a  issue 13 / 16: LeanSparse's coarse pass through the jax-triton FP8 kernel inside the
#           decode step (LeanSparseConfig.coarse_implementation, common.batch_folding), at 128K
#           B 64 and 512K B 32, beside HiSparse; pipelined steps, profiled.
#   STEP=b  issue 15: the speculative experiment whole again after the index_scores fix (its
#           LeanSparse rows predate it; leansparse C8 never ran), resumable (see the part).
#   STEP=c  issue 14: capacity at 200K timed at min(N, 256) copies (pipelined steps), then replay
#           and loadstep (benchmarks/serving_gpu.sh, one context / method per call).
#   STEP=d  the word-view fix of 1-byte host pools on the GPU (tests), capacity at 200K resumed.
source benchmarks/gpu_lib.sh
STEP=${STEP:-a}
JT="--gin LeanSparseConfig.coarse_implementation=\\\"'jax_triton'\\\""
case "$STEP" in
  a)
    part jt128 290 "python3 benchmarks/decode_profile_gpu.py --methods leansparse_fp8 --kv-dtype fp8_v4 --attention-precision f32 $JT --out \$OUT --budget-s 280"
    part jt512 290 "python3 benchmarks/decode_profile_gpu.py --methods hisparse,leansparse_fp8 --context 524288 --batch 32 --steps 8 --kv-dtype fp8_v4 --attention-precision f32 $JT --out \$OUT --budget-s 280" ;;
  b)
    # results come back in b.tar (spec/speculative/results.json); to resume in a later call,
    # commit that file and add --gin.speculative.resume_from="'<its path>'"
    part spec 560 "python3 -m experiments.cli run configs/experiments/speculative.gin --gin.speculative.time_limit_s=480 --gin.speculative.results_dir=None \"--gin.run.name='speculative'\"" ;;
  c)
    part capacity 560 "STEP=capacity bash benchmarks/serving_gpu.sh" ;;
  d)
    # after c's illegal address (leansparse 200K x 164: a 3.8 GB e4m3 host pool, int32 offsets
    # in Pallas-Triton wrapped): the kernels' word view on the GPU, then capacity resumed
    part big_pools 80 "python3 -m pytest -q -p no:cacheprovider -m gpu -k 3gib tests/test_kernel_hot_resolve.py tests/test_kernel_gather_rows.py"
    # (part words added after session 10's run: is the e4m3 word view read in place?)
    part words 60 "python3 benchmarks/gather_rows_gpu.py --out \$OUT --dtype float8_e4m3fn"
    # (session 10's 270 s was cut while compiling on a fresh machine; session 11 ran words and
    # capacity as benchmarks/gpu_session11.sh STEP=a)
    part capacity $(( ${CAP_LIMIT:-270} + 10 )) "PRIOR=$ROOT/results/gpu_session10/capacity_first LIMIT=${CAP_LIMIT:-270} STEP=capacity bash benchmarks/serving_gpu.sh" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
