#!/usr/bin/env bash
# Session 24's GPU calls (device tool, carry [".whl"]):
#   call 1 (~480 s): spec_rerun then attn_sweep
#     spec_rerun  issue 15: hisparse, leansparse, adaptive at C1-C8 again (a second sample of
#                 the committed cells: the run-to-run spread of the speed-ups, hisparse C4 among
#                 them) with selection_overlap recorded (sel_u/s: union/sum of the block's
#                 selections, beside union/sum of its misses) -> results/speculative_rerun/
#     attn_sweep  issue 16: sparse_attention v2 at B = 64, bf16 and FP8 rows, XLA / Triton v1 /
#                 v2 and the launch-parameter sweep (col_splits, splits, warps, blocks; no
#                 Mosaic) -> sparse_attention_v2_gpu.json
#   call 2 (STEP2=1, ~300 s): spec_rerun resumed from results/speculative_rerun/ (copy call 1's
#     results.json there first), then attn_confirm: the default and the two fastest bf16
#     variants of call 1, each three times in one process.
# PARTS="spec_rerun" (or "attn_sweep", "attn_confirm") runs one part of a call.
source "$(dirname "$0")/gpu_lib.sh"

# spec_rerun SECONDS TIME_LIMIT EXTRA_GIN...: the second speculative sample, time-limited
spec_rerun() {
  local secs=$1 limit=$2; shift 2
  TAIL=20 part spec_rerun "$secs" "python3 -m experiments.cli run \
    configs/experiments/speculative.gin \"--gin.run.name='speculative_rerun'\" \
    \"--gin.speculative.methods=('hisparse', 'leansparse', 'adaptive')\" \
    \"--gin.speculative.concurrencies=(1, 2, 4, 8)\" --gin.speculative.time_limit_s=$limit $*"
}

if [ -n "${STEP2:-}" ]; then
  spec_rerun 200 175 \
    "\"--gin.speculative.resume_from='$ROOT/results/speculative_rerun/results.json'\"" \
    --gin.speculative.results_dir=None
  TAIL=14 part attn_confirm 100 "python3 benchmarks/sparse_attention_v2_gpu.py --out \$OUT \
    --rows bfloat16 --batches 64 --no-mosaic --budget-s 80 \
    --sweep ';block_k=64;num_stages=3;block_k=64,num_stages=3;;block_k=64;num_stages=3;block_k=64,num_stages=3;;block_k=64;num_stages=3'"
  pack session24b
else
  spec_rerun 300 270 "\"--gin.speculative.results_dir='$ROOT/results/speculative_rerun'\""
  TAIL=60 part attn_sweep 200 "python3 benchmarks/sparse_attention_v2_gpu.py --out \$OUT \
    --rows bfloat16,fp8 --batches 64 --no-mosaic --budget-s 170"
  pack session24
fi
