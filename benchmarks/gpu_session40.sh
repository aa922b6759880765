#!/usr/bin/env bash
# Session 40's GPU calls (device tool, carry [".whl"]):
# STEP=rows (~200 s): benchmarks/host_rows_gpu.py, random pinned-host row reads by layout
#   (V4's FP8 row as three arrays vs packed; 512 B / 2 KiB references; a device pool; a small
#   host pool), 64 rows a program at 4 warps, then 16 rows a program and 8 warps for the
#   split and packed layouts -> $OUT/rows{,_kb16,_w8}/ (commit to results/host_rows_s40/).
# STEP=seq (~500 s): host_rows_gpu.py's sequential reads (the link's streaming rate on this
#   machine) -> $OUT/seq/; then issue 16's default kernel_compare config (all five ops, with
#   session 39's launches; session 37's STEP=kc) -> $OUT/kc/kernel_compare/.
# STEP=keys (~120 s): benchmarks/pooled_reads_gpu.py, HiSparse's decode indexer over device
#   pages at 512K (N 131104) and batch 8 / 36: the f32-q kernel (hi + lo split, two bf16 dots)
#   against the fp8 x fp8 form and a bf16 q -> $OUT/keys/ (commit to results/pooled_reads_s40/).
# STEP=fp8 (~330 s): STEP=keys, then the per-op decode profile of session 39's profile36
#   (512K, batch 36, p = 0.3, bf16 weights and attention, FP8 rows) at
#   IndexerConfig.score_precision "fp8" (V4's fp8 x fp8 indexer arithmetic for both methods'
#   exact scores) -> $OUT/profile_b36_512k_p03_fp8/.
# STEP=paged41 (~220 s): launch_variants_gpu.py --set s41, HiSparse's paged decode indexer at
#   512K, batch 36 (launch tunables, bf16 q, fp8 x fp8), 25 rounds -> $OUT/paged41/ (commit
#   to results/launch_variants_s41/).
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-rows}" in
  rows)
    TAIL=14 part rows ${ROWS_S:-150} "python3 benchmarks/host_rows_gpu.py --out \$OUT"
    TAIL=6 part rows_kb16 ${ROWS2_S:-80} "python3 benchmarks/host_rows_gpu.py --out \$OUT \
      --kb 16 --layouts split3,split3_first,packed146"
    TAIL=6 part rows_w8 ${ROWS2_S:-80} "python3 benchmarks/host_rows_gpu.py --out \$OUT \
      --warps 8 --layouts split3,split3_first,packed146" ;;
  seq)
    TAIL=5 part seq ${SEQ_S:-70} "python3 benchmarks/host_rows_gpu.py --out \$OUT \
      --layouts rows512_seq,packed160_seq,f32_2k_seq"
    STEP=kc bash benchmarks/gpu_session37.sh ;;
  keys|fp8)
    TAIL=8 part keys ${KEYS_S:-150} "python3 benchmarks/pooled_reads_gpu.py --coarse none \
      --keys paged,paged_fp8,paged_bf16q --out \$OUT"
    [ "$STEP" = fp8 ] && PROFILE_GIN="--gin \"model_preset.weight_dtype='bf16'\" \
      --gin \"model_preset.attention_precision='bf16'\" --gin \"model_preset.kv_dtype='fp8_v4'\" \
      --gin \"model_preset.score_precision='fp8'\" --input-repeat 0.3" \
      profile profile_b36_512k_p03_fp8 524288 36 ${PROFILE_S:-200} ;;
  paged41) variants paged41 s41 25 ${LAUNCH_S:-200} ;;
  *) echo "STEP=${STEP}: unknown (rows | seq | keys | fp8 | paged41)"; exit 2 ;;
esac
