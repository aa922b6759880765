#!/usr/bin/env bash
# Issue 16's missing bounds, two ways in one device call (carry [".whl"], ~350 s):
# 1. input ablations timed without counters (benchmarks/kernel_ablation_gpu.py, ~150 s): the
#    slope and intercept of each kernel's time in its size, and pq_topc with conflict-free
#    codebook gathers;
# 2. Nsight Compute counters of the pq_topc score kernel, topk's three kernels, index_scores
#    (fp8) and sparse_attention v2 at their target shapes (B = 64), one ncu process per op
#    (benchmarks/kernel_ncu_gpu.py), then a summary table. ncu reads counters only on a
#    Firecracker machine (KINDS.md: on gVisor it fails with LibraryNotLoaded); `uname -r` is
#    printed before it (fc = Firecracker), and a failing ncu leaves its log in
#    $OUT/ncu_<op>.log. --clock-control none: leave the clocks alone. Command buffers off, so
#    each kernel launches on its own (ncu does not see into CUDA graphs).
# OPS: the ops profiled (default the four above; also sparse_attention_mosaic(_loop), the
# Mosaic GPU kernel, and pq_topc_zero_codes, the score kernel with every code 0); ABLATE=0
# skips step 1. Session 25 ran the default (80 s wall, results/kernel_ncu/). Shared-memory
# wavefronts and bank conflicts (loads, stores) are in the CSVs and summary.json since
# session 26.
# SOURCE=1 (session 44): instead, per-instruction warp-stall sampling (ncu's SourceCounters)
# of one launch of each of $OPS' kernels ($SOURCE_REGEX_<op> overrides the op's regex), the
# SASS page as CSV ($OUT/sass_<op>.csv) and its summary (kernel_ncu_gpu.py --sass: the
# instructions and opcodes that hold the samples) -> $OUT/sass_summary.json.
source "$(dirname "$0")/gpu_lib.sh"
if [ "${ABLATE:-1}" = 1 ]; then
  echo "== ablations"
  timeout 200 python3 benchmarks/kernel_ablation_gpu.py --out "$OUT" --budget-s 150 2>&1 \
    | quiet | tail -14
fi
uname -r
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}"; [ -n "$NCU" ] || { pack kernel_ncu; exit 1; }
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
if [ "${SOURCE:-0}" = 1 ]; then
  mkdir -p "$OUT"
  for op in ${OPS:-sparse_attention topk index_scores}; do
    var="SOURCE_REGEX_$op"; re=${!var:-$(python3 benchmarks/kernel_ncu_gpu.py --op "$op" --regex)}
    echo "== $op source (kernels: $re)"
    timeout "${NCU_S:-150}" "$NCU" --clock-control none --target-processes all -k "regex:$re" \
      -c "${LAUNCHES:-1}" --set none --section SourceCounters --section WarpStateStats \
      --warp-sampling-interval "${SAMPLING:-0}" \
      --import-source no -f -o "$OUT/src_$op" python3 benchmarks/kernel_ncu_gpu.py --op "$op" \
      > "$OUT/src_$op.log" 2>&1
    echo "-- $op exit $?"; tail -3 "$OUT/src_$op.log"
    "$NCU" -i "$OUT/src_$op.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/sass_$op.csv" 2> "$OUT/sass_$op.err"
    echo "-- $op sass: $(wc -l < "$OUT/sass_$op.csv") lines"; head -c 600 "$OUT/sass_$op.csv"; echo
  done
  python3 benchmarks/kernel_ncu_gpu.py --sass "$OUT"/sass_*.csv --json "$OUT/sass_summary.json"
  rm -f "$OUT"/*.ncu-rep  # MBs each; the CSVs hold what is read here
  pack kernel_ncu_source
  exit 0
fi
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
METRICS="--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"
METRICS+=",l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
METRICS+=",l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
METRICS+=",smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum"
for op in ${OPS:-pq_topc topk index_scores sparse_attention}; do
  re=$(python3 benchmarks/kernel_ncu_gpu.py --op "$op" --regex)
  echo "== $op (kernels: $re)"
  timeout "${NCU_S:-120}" "$NCU" --clock-control none --target-processes all \
    -k "regex:$re" -c "${LAUNCHES:-6}" $SECTIONS $METRICS --csv --page raw \
    python3 benchmarks/kernel_ncu_gpu.py --op "$op" > "$OUT/ncu_$op.csv" 2> "$OUT/ncu_$op.log"
  echo "-- $op exit $? ($(grep -c '^"' "$OUT/ncu_$op.csv") csv lines)"
  tail -3 "$OUT/ncu_$op.log"
done
python3 benchmarks/kernel_ncu_gpu.py --summarize "$OUT"/ncu_*.csv --json "$OUT/summary.json"
pack kernel_ncu
