#!/usr/bin/env bash
# Session 41's GPU calls (device tool, carry [".whl"]):
# STEP=colaunch (~150 s): benchmarks/colaunch_gpu.py, a host-row copy (the key fetch's
#   132-byte rows) and the Pallas coarse PQ pass (fp8, N 131104) in one launch vs apart, at
#   batch 18 (half of 36: one request group) and M 12288 / 36864 rows (the 512K step's key
#   fetch: ~12.6K rows a layer for 18 requests), the three program orders -> $OUT/colaunch/
#   (commit to results/colaunch_s41/); then the same at bf16.
# STEP=p950 (~450 s): the decode profile of STEP=fp8 (gpu_session40.sh: bf16 weights and
#   attention, FP8 rows, p = 0.3) at 950K (972800 tokens), batch 20 (HiSparse's capacity
#   there, capacity_s37), with score_precision "fp8" then "f32" (the prefill cached between
#   them) -> $OUT/profile_b20_950k_p03_{fp8,f32}/.
# STEP=serve41 (~450 s a context): configs/experiments/capacity_s41.gin (capacity_s39 at
#   score_precision "fp8") at CONTEXTS (default "(524288,)") -> $OUT/capacity/capacity_s41/.
# STEP=one (~420 s): STEP=colaunch's fp8 part, then STEP=p950's fp8 profile (one call: a
#   refused start costs ~180 s of device time).
source "$(dirname "$0")/gpu_lib.sh"
p950() {  # p950 PRECISIONS: the 950K batch-20 profile at each score precision
  for sp in $1; do
    PROFILE_GIN="--gin \"model_preset.weight_dtype='bf16'\" \
      --gin \"model_preset.attention_precision='bf16'\" --gin \"model_preset.kv_dtype='fp8_v4'\" \
      --gin \"model_preset.score_precision='$sp'\" --input-repeat 0.3" \
      profile profile_b20_950k_p03_$sp 972800 20 ${PROFILE_S:-260}
  done
}
case "${STEP:-colaunch}" in
  colaunch|one)
    TAIL=12 part colaunch ${CO_S:-100} "python3 benchmarks/colaunch_gpu.py --out \$OUT"
    if [ "${STEP:-}" = one ]; then p950 fp8; else
      TAIL=8 part colaunch_bf16 ${CO2_S:-60} "python3 benchmarks/colaunch_gpu.py --out \$OUT \
        --precision bf16 --rows 12288"
    fi ;;
  p950) p950 "fp8 f32" ;;
  serve41) capacity capacity_s41 ;;
  *) echo "STEP=${STEP}: unknown (colaunch | p950 | serve41 | one)"; exit 2 ;;
esac
