#!/usr/bin/env bash
# Prepared in session 20 for the next GPU session (device tool, carry [".whl"]), one call per
# STEP; every part is time-limited and resumable. Results come back as $OUT/<STEP>.tar.
#   STEP=spec_c  issue 15: speculative.gin from C1 to the largest concurrency the paper uses
#                (C16, C32, C64 added to the committed C1-C8), resumed from
#                results/speculative/results.json (its C1-C8 cells are kept, not rerun); rerun
#                (after copying the returned results.json into results/speculative/) until the
#                table says complete.
#   STEP=replay  issue 14: the multi-turn replay with trained-like reuse (replay.input_repeat
#                = 0.3: Scheduler(inputs=RepeatInputs(0.3))), METHOD (default leansparse) per
#                call into results/replay_p0.3 (resumed: copy the returned results.json there
#                between calls; then METHOD=echo, METHOD=hisparse).
#   STEP=kprofile issue 16: kernel_compare at the five target shapes only, every
#                implementation, each row also profiled (kernel_compare.profile: kernels,
#                busy_us, span_us and the largest kernels per call): busy ~= span says the
#                kernels take the time, busy << span the gaps; the per-kernel split shows
#                which launch of an op dominates (~150 s).
source "$(dirname "$0")/gpu_lib.sh"
STEP=${STEP:-spec_c}
case "$STEP" in
  spec_c)
    TAIL=30 part spec_c 560 "python3 -m experiments.cli run configs/experiments/speculative.gin \
      \"--gin.speculative.concurrencies=(1, 2, 4, 8, 16, 32, 64)\" \
      \"--gin.speculative.resume_from='$ROOT/results/speculative/results.json'\" \
      --gin.speculative.results_dir=None --gin.speculative.time_limit_s=480" ;;
  replay)
    TAIL=30 part replay 570 "PRIOR=$ROOT/results LIMIT=550 RUN_NAME=replay_p0.3 STEP=replay \
      METHOD=${METHOD:-leansparse} bash $ROOT/benchmarks/serving_gpu.sh \
      --gin.replay.input_repeat=0.3" ;;
  kprofile)
    TAIL=40 part kprofile 300 "python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
      \"--gin.run.name='kernel_profile'\" --gin.kernel_compare.batches=\"(64,)\" \
      --gin.kernel_compare.histories=\"(131072,)\" \
      --gin.kernel_compare.topk_shapes=\"((64, 262144, 2048),)\" \
      --gin.kernel_compare.profile=True --gin.kernel_compare.budget_s=240" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
pack "$STEP"
