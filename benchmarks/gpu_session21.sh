#!/usr/bin/env bash
# Prepared in session 21 for the next GPU sessions (device tool, carry [".whl"]), one call per
# STEP; every part is time-limited and resumable. Results come back as $OUT/<STEP>.tar.
#   STEP=groups_nocb issue 13 deliver 4: the request-groups profile with XLA's command buffers
#                (CUDA graphs) off as well ("nocb"), g2 then g1, beside the default flags'
#                g1 and g2 (~220 s). Session 21 found every g2 kernel on one stream with
#                command buffers on; `concurrent_us` counts kernels that ran at once whatever
#                stream the trace names.
#   STEP=replay_long issue 14 deliver 5: the replay with agentic output lengths (512-2048, the
#                run whose TTFT target is met with free-running random weights) driven with
#                trained-like reuse (replay.input_repeat = 0.3), METHODS (default "echo
#                leansparse"; then METHODS=hisparse) one after another, ~300 s each, resumed
#                from results/replay_long_out_p0.3/ (copy the returned results.json there
#                between calls).
#   STEP=loadstep issue 14 deliver 5: loadstep.gin with residency.input_repeat = 0.3 (~240 s),
#                run name loadstep_p0.3.
#   STEP=spec_c  issue 15: as benchmarks/gpu_session20.sh STEP=spec_c (C1-C64, resumed from
#                results/speculative/results.json).
#   STEP=spec_lean issue 15: leansparse alone at C8, C16, C32 with the block coarse pass of
#                session 23 (CoarseToFineIndex.select_block), into results/speculative_lean_block/
#                (not resumed from results/speculative/, whose leansparse cells predate it;
#                ~300 s).
# Issue 13's 1M cells at batch 64 and 32 are a scale run:
#   RUN=scale_batch_1m SCALE_BUDGET=550 STEP=scale bash benchmarks/gpu_scale_batch.sh
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-groups_nocb}
case "$STEP" in
  groups_nocb)
    TAIL=14 part groups_nocb 300 "python3 benchmarks/groups_profile_gpu.py --out \$OUT \
      --variants g1,g2 --lhs-variants '' --nocb-variants g2,g1 --budget-s 270" ;;
  replay_long)
    for m in ${METHODS:-echo leansparse}; do
      TAIL=8 part replay_long ${REPLAY_S:-290} "PRIOR=$ROOT/results LIMIT=$(( ${REPLAY_S:-290} - 10 )) \
        RUN_NAME=replay_long_out_p0.3 STEP=replay METHODS= METHOD=$m bash $ROOT/benchmarks/serving_gpu.sh \
        --gin.replay.input_repeat=0.3 '--gin.replay.output_tokens=(512, 2048)'"
      mkdir -p "$ROOT/results/replay_long_out_p0.3"  # the next method resumes from this one
      cp "$OUT/replay_long/replay_long_out_p0.3/results.json" \
        "$ROOT/results/replay_long_out_p0.3/" 2>/dev/null
    done ;;
  loadstep)
    TAIL=12 part loadstep 300 "LIMIT=290 RUN_NAME=loadstep_p0.3 STEP=loadstep \
      bash $ROOT/benchmarks/serving_gpu.sh --gin.residency.input_repeat=0.3" ;;
  spec_c) STEP=spec_c bash "$(dirname "$0")/gpu_session20.sh"; exit ;;
  spec_lean)
    TAIL=12 part spec_lean 400 "python3 -m experiments.cli run configs/experiments/speculative.gin \
      \"--gin.run.name='speculative_lean_block'\" \"--gin.speculative.methods=('leansparse',)\" \
      \"--gin.speculative.concurrencies=(8, 16, 32)\" --gin.speculative.time_limit_s=360 \
      \"--gin.speculative.results_dir='$ROOT/results/speculative_lean_block'\"" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
