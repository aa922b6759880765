#!/usr/bin/env bash
# What session 31 left for the next GPU calls (device tool, carry [".whl"]); everything under
# $OUT comes back in one tar (STEP=profile) or as the scale run's files.
# STEP=profile (default; ~330 s warm, one call): the decode profiles with candidate_topk's
#   launch default of 256 lanes (session 31's sweep; 30 us a CSA layer in the step at 128 lanes):
#   128K at batch 1 and 8 (compare results/decode_profile_session31/b{1,8}), and 512K at
#   batch 8, where issue 13's <= 0.85 is 0.86-0.89 (not profiled since the sort removal: where
#   LeanSparse's 3.2-3.4 ms go against HiSparse's 3.7-3.8). Each with the HLO census; read the
#   traces' idle gaps with benchmarks/trace_gaps.py.
# STEP=scale (~300 s, one call): 512K batches 8 and 1 in five timed blocks a cell
#   (configs/experiments/scale_small_batch_s31.gin); copy $OUT/scale_small_batch_s31/ into
#   results/ and regenerate the README table (the ratio then shows the blocks' range).
# STEP=b64 (~200 s, one call, fresh process): 512K batch 64, killed in session 31 as the
#   fourth cell of one process; free memory and /tmp usage are logged before and after.
source "$(dirname "$0")/gpu_lib.sh"
profile() {  # profile NAME CONTEXT BATCH SECONDS
  TAIL=40 part "$1" "$4" "python3 benchmarks/decode_profile_gpu.py \
    --methods hisparse,leansparse_fp8_jt --context $2 --batch $3 --hlo-census \
    --gin \"model_preset.matmul_precision='bf16'\" --prefill-cache /tmp/lsparse_scale_prefill \
    --out \$OUT --budget-s $(( $4 - 10 ))"
}
memory() { free -g | head -2; df -h /tmp | tail -1; du -sh /tmp/lsparse_scale_prefill 2>/dev/null; }
case "${STEP:-profile}" in
  profile)
    profile b1 131072 1 100
    profile b8 131072 8 100
    profile b8_512k 524288 8 150
    pack session32_profile ;;
  scale)
    RUN=scale_small_batch_s31 SCALE_BUDGET=${SCALE_BUDGET:-480} STEP=scale \
      bash "$(dirname "$0")/gpu_scale_batch.sh" ;;
  b64)
    memory
    RUN=scale_small_batch_s30 SCALE_BUDGET=${SCALE_BUDGET:-400} \
      SCALE_ARGS="--gin.scale.batches=(64,)" STEP=scale bash "$(dirname "$0")/gpu_scale_batch.sh"
    memory ;;
  *) echo "STEP=${STEP}: unknown (profile | scale | b64)"; exit 2 ;;
esac
