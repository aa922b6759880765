#!/usr/bin/env bash
# Session 47's GPU calls (device tool, carry [".whl"]); the card is printed first. The session
# ran these steps on successive forms of topk's select kernel (benchmarks/RESULTS.md "Session
# 47" says which call ran which); as committed they run the final form:
# STEP=a (~120 s): the fused topk's GPU tests (every variant) -> $OUT/gputests/; the probe's
#   select stage at its launches -> $OUT/probe/; then launch_variants_gpu.py --set s47 (topk
#   64 x 262144, k 2048: chunk 4096 against 2048, 4 warps, block 32768, an 8-warp finish;
#   device time a call from 2 profiles each) -> $OUT/lv/.
# STEP=probe (~60 s): benchmarks/select_probe_gpu.py: the select kernel's stages (loads alone,
#   + compare and count, + prefix sums, the real select) at its launches -> $OUT/probe/;
#   PROBE_ARGS="--floors 100,3.0,2.6,2.2,1.9": the select alone at each floor (none to ~7500
#   candidates a row); PROBE_ARGS=--ablate: the select without its -1 fill, its scatter, both.
# STEP=ncu (~60 s): the probe's kernels under Nsight Compute (registers, achieved occupancy
#   and what limits it, memory throughput) -> $OUT/ncu/ncu.csv and a table.
# STEP=d (~230 s): the fused GPU tests' default variant, kernel_compare's topk rows (as
#   gpu_session46.sh STEP=topk) -> $OUT/kc/, and the 512K batch-36 fp8 decode profile (as
#   gpu_session45.sh STEP=p512) -> $OUT/p512/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-a}" in
  a)
    TAIL=6 part gputests ${TESTS_S:-90} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py -k 'fused_on_gpu'"
    TAIL=12 part probe ${PROBE_S:-120} "python3 benchmarks/select_probe_gpu.py --out \$OUT \
      --stages select"
    LV_ARGS="--busy 2" variants lv s47 ${LV_ROUNDS:-10} ${LV_S:-150} ;;
  probe)
    TAIL=30 part probe ${PROBE_S:-200} "python3 benchmarks/select_probe_gpu.py --out \$OUT ${PROBE_ARGS:-}" ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-not found}"; uname -r; mkdir -p "$OUT/ncu"
    timeout ${NCU_S:-240} "$NCU" --clock-control none --target-processes all \
      -k "regex:probe_|topk_fused_select" --set none --section LaunchStats \
      --section Occupancy --section SpeedOfLight --csv --page raw \
      python3 benchmarks/select_probe_gpu.py --profiles 0 --out "$OUT/ncu" \
      > "$OUT/ncu/ncu.csv" 2> "$OUT/ncu/ncu.log"; echo "ncu exit $?"
    python3 benchmarks/select_probe_gpu.py --ncu-table "$OUT/ncu/ncu.csv" ;;
  d)
    TAIL=6 part gputests ${TESTS_S:-90} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py -k 'fused_on_gpu and default'"
    TAIL=12 part kc ${KC_S:-120} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin \"--gin.kernel_compare.ops=('topk',)\" \
      \"--gin.kernel_compare.topk_shapes=((64, 262144, 2048),)\" \
      \"--gin.kernel_compare.implementations=('xla', 'triton_fused')\" \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'"
    PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-210} ;;
  *) echo "STEP=${STEP}: unknown (a | probe | ncu | d)"; exit 2 ;;
esac
