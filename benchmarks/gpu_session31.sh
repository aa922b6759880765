#!/usr/bin/env bash
# Session 31 (device tool, carry [".whl"]): XLA's command buffers (CUDA graphs) in LeanSparse's
# decode step. The 128K batch-8 trace of session 30's code (results/decode_profile_session31/b8)
# shows the GPU idle ~300 us a step between pq_scores_kernel and topk_fused_threshold while the
# host runs
# `command_buffer::update` (376 us) and `cuGraphLaunch` (298 us) of the graph that follows: the
# step waits on the host, not on kernels (step 3.88 ms, kernels 2.96 ms).
# STEP=nocb (default; ~200 s warm, one call), with XLA_FLAGS=--xla_gpu_enable_command_buffer=
# (every thunk launched on its own) against the default in the same call:
#   1. the 128K batch-8 decode profile (HiSparse, leansparse_fp8_jt) with command buffers off;
#   2. 512K batch 8 and 1, both methods, command buffers off, then on (run names
#      scale_nocb_s31 / scale_cb_s31).
source "$(dirname "$0")/gpu_lib.sh"
NOCB="--xla_gpu_enable_command_buffer="
scale512() {  # scale512 NAME XLA_FLAGS SECONDS
  TAIL=6 part "$1" "$3" "XLA_FLAGS='$2' python3 -m experiments.cli run \
    configs/experiments/scale_small_batch.gin \"--gin.run.name='$1'\" \
    \"--gin.scale.batches=(8, 1)\" \"--gin.scale.prefill_cache='/tmp/lsparse_scale_prefill'\" \
    --gin.scale.time_budget_s=$(( $3 - 20 ))"
}
case "${STEP:-nocb}" in
  nocb)
    TAIL=40 part b8_nocb 120 "XLA_FLAGS='$NOCB' python3 benchmarks/decode_profile_gpu.py \
      --methods hisparse,leansparse_fp8_jt --context 131072 --batch 8 \
      --gin \"model_preset.matmul_precision='bf16'\" --prefill-cache /tmp/lsparse_scale_prefill \
      --out \$OUT --budget-s 110"
    scale512 scale_nocb_s31 "$NOCB" 160
    scale512 scale_cb_s31 "" 120
    pack session31_nocb ;;
  *) echo "STEP=${STEP}: unknown (nocb)"; exit 2 ;;
esac
