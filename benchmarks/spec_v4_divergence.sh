#!/usr/bin/env bash
# Session 17's diagnostic (device tool, carry [".whl"]): where speculative_v4.gin's greedy tokens
# depart from plain decoding (hisparse, C8, random V4-slice weights, untrained drafter), with the
# model's matmuls in bf16 (as committed) and in f32 ("highest"). If only bf16 departs, the cause
# is bf16 rounding that differs between a T = 1 step and a T = gamma + 1 verification's shapes.
source "$(dirname "$0")/gpu_lib.sh"
PARTS=${PARTS:-bf16 f32}
for prec in bf16 highest; do
  name=bf16; [ "$prec" = bf16 ] || name=f32
  TAIL=4 part $name ${SECS:-150} "python3 -m experiments.cli run configs/experiments/speculative_v4.gin \
    \"--gin.speculative.methods=('hisparse',)\" \"--gin.model_preset.matmul_precision='$prec'\" \
    --gin.speculative.results_dir=None \"--gin.run.name='spec_v4_$name'\""
done
pack spec_div
