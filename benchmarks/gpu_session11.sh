#!/usr/bin/env bash
# Session 11's GPU calls (device tool, carry [".whl"]), one call per STEP; each part is
# time-limited and resumable (results.json rewritten after every cell).
#   STEP=a  the e4m3 word view of a pinned-host pool: read in place or staged?
#           (benchmarks/gather_rows_gpu.py), then capacity at 200K resumed from session 10
#           (LeanSparse at its N = 164, after the int32-offset fix).
#   STEP=b  capacity at 512K, resumed from results/capacity/results.json (STEP=a's, copied there).
#   STEP=c  capacity at 950K, resumed likewise.
#   STEP=d  the C8 load step at 32K (configs/experiments/loadstep.gin), as long as time is left.
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-a}
cap() {  # cap CONTEXT PRIOR LIMIT
  part "capacity" $(( $3 + 10 )) "PRIOR=$ROOT/$2 LIMIT=$3 CONTEXTS=\"($1,)\" STEP=capacity bash benchmarks/serving_gpu.sh"
}
case "$STEP" in
  a)
    part words 60 "python3 benchmarks/gather_rows_gpu.py --out \$OUT --dtype float8_e4m3fn"
    cap 204800 results/gpu_session10/capacity_first ${CAP_LIMIT:-470} ;;
  b) cap 524288 results ${CAP_LIMIT:-540} ;;
  c) cap 972800 results ${CAP_LIMIT:-540} ;;
  d) part loadstep $(( ${CAP_LIMIT:-380} + 10 )) "LIMIT=${CAP_LIMIT:-380} STEP=loadstep bash benchmarks/serving_gpu.sh" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
