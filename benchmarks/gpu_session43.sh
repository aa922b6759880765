#!/usr/bin/env bash
# Session 43's GPU calls (device tool, carry [".whl"]); the card (H100 or H200) is printed
# first and named in benchmarks/RESULTS.md:
# STEP=keys (~280 s): host_rows_gpu.py --layouts keys: LeanSparse's indexer-key rows read at
#   random from a 16.8M-row pinned-host pool as the host key pages store them (values and
#   scale in two arrays) against one packed 132-byte row, padded forms and the values alone,
#   M 12288 / 24576 rows (the 512K key fetch of 18 / 36 requests a CSA layer) -> $OUT/keys/;
#   then gpu_session42.sh's kc42 (kernel_compare_s42_index.gin, ~150 s) -> $OUT/kc/.
# STEP=kc (~450 s): the default kernel_compare config, all five ops at issue 16's shapes,
#   traced (as gpu_session37.sh STEP=kc) -> $OUT/kc/kernel_compare/.
# STEP=profiles (~480 s): the fp8 decode profiles of session 42 (512K batch 36, 950K batch
#   20; gpu_session42.sh STEP=fp8mma's third part and STEP=p950fp8) -> $OUT/p512/, $OUT/p950/.
# STEP=packed (~500 s): LeanSparse's host key rows packed (LeanSparseConfig.host_key_rows =
#   "packed": one 33-word row a key): the hot_resolve GPU tests of packed pools, then the
#   512K batch-36 fp8 decode profile of hisparse, leansparse_fp8_jt (split rows) and
#   leansparse_fp8_jt_pk (packed) -> $OUT/p512pk/.
source "$(dirname "$0")/gpu_lib.sh"
case "${STEP:-keys}" in
  keys)
    TAIL=12 part keys ${KEYS_S:-150} "python3 benchmarks/host_rows_gpu.py --layouts keys \
      --rows 12288,24576 --pool-rows 16777216 --out \$OUT"
    TAIL=30 part kc ${KC_S:-170} "python3 -m experiments.cli run \
      configs/experiments/kernel_compare_s42_index.gin 2>&1 | grep -v ' spent$'" ;;
  kc)
    TAIL=60 part kc $(( ${KC_BUDGET_S:-300} + 150 )) "python3 -m experiments.cli run \
      configs/experiments/kernel_compare.gin --gin.kernel_compare.budget_s=${KC_BUDGET_S:-300} \
      --gin.kernel_compare.profile=True 2>&1 | grep -v ' spent$'" ;;
  profiles)
    PROFILE_GIN=$FP8_GIN profile p512 524288 36 ${PROFILE_S:-220}
    PROFILE_GIN=$FP8_GIN profile p950 972800 20 ${P950_S:-260} ;;
  packed)
    TAIL=8 part gputests ${TESTS_S:-150} "python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernel_hot_resolve.py -k 'packed or fp8_v4'"
    METHODS=${METHODS:-hisparse,leansparse_fp8_jt,leansparse_fp8_jt_pk} PROFILE_GIN=$FP8_GIN \
      profile p512pk 524288 36 ${PROFILE_S:-330} ;;
  *) echo "STEP=${STEP}: unknown (keys | kc | profiles | packed)"; exit 2 ;;
esac
