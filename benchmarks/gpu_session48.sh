#!/usr/bin/env bash
# Session 48's GPU calls (device tool, carry [".whl"]); the card is printed first.
# STEP=probe (~350 s): the GPU tests of the new forms (the fused topk's skip_ties, two finish
#   programs a row with prefix sums through a view, searches by thirds; candidate_topk and
#   the fused rescoring + top-512 searching by thirds) -> $OUT/gputests/;
#   benchmarks/finish_probe_gpu.py: topk's finish kernel by stages (the candidate row's
#   load, the keys, the radix search, the slots, the real finish) and its threshold launch
#   (the sample's loads, the real one) -> $OUT/probe/.
# STEP=lv (~500 s): the GPU tests as STEP=probe (PARTS=lv skips them), then
#   launch_variants_gpu.py --set s48 (topk: the threshold launch against a floor search in
#   every select program, the finish's forms, searches by thirds; the rescoring + top-512, fused and split, searching by thirds; device time from
#   2 profiles each; LV_OPS=topk: its topk rows alone) -> $OUT/lv/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-probe}" in
  probe)
    TAIL=6 part gputests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py tests/test_kernel_candidate_topk.py \
      tests/test_kernel_index_scores.py -k 'fused_on_gpu and (skip_ties or finish_2x64 or \
      thirds) or gpu_kernel_matches_twin or gpu_fp8_variants'"
    TAIL=20 part probe ${PROBE_S:-150} "python3 benchmarks/finish_probe_gpu.py --out \$OUT" ;;
  lv)
    TAIL=6 part gputests ${TESTS_S:-120} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_topk.py tests/test_kernel_candidate_topk.py \
      tests/test_kernel_index_scores.py -k 'fused_on_gpu and (skip_ties or finish_2x64 or \
      thirds) or gpu_kernel_matches_twin or gpu_fp8_variants'"
    LV_ARGS="--busy 2 ${LV_OPS:+--ops $LV_OPS}" variants lv s48 ${LV_ROUNDS:-5} ${LV_S:-380} ;;
  *) echo "STEP=${STEP}: unknown (probe | lv)"; exit 2 ;;
esac
