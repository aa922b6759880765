# Shared by the benchmarks/gpu_session*.sh scripts (sourced, not run): the GPU machine's setup
# (carried wheels into /tmp/site, a persistent compilation cache within the call), `quiet` (drops
# progress-bar lines), `part` (one bounded piece of a call) and `pack` (one tar to bring back).
set -uo pipefail
# once a call: a session script that runs another one's steps (which sources this again) skips
# the install and the card's lines
if [ -z "${GPU_LIB_SET_UP:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT ROOT=$PWD
if [ -z "${GPU_LIB_SET_UP:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  export GPU_LIB_SET_UP=1
fi

quiet() { tr '\r' '\n' | grep -v "it/s\]\|tok/s\]\|req/s\]\|example/s\]\|Deprecation" ; }

# part NAME SECONDS COMMAND: runs COMMAND (a bash string) with a timeout, from the carried
# branch snapshot .branches/NAME when there is one (else this tree), its output under
# $OUT/NAME; skipped unless NAME is in $PARTS (unset: every part runs).
part() {
  local name=$1 secs=$2; shift 2
  if [ -n "${PARTS:-}" ]; then case " $PARTS " in *" $name "*) ;; *) return;; esac; fi
  echo "== $name ($secs s)"; mkdir -p "$OUT/$name"
  local dir=$ROOT/.branches/$name; [ -d "$dir" ] || dir=$ROOT
  (cd "$dir" && export PYTHONPATH=/tmp/site:$dir OUT=$OUT/$name LSPARSE_RUNS=$OUT/$name \
    && timeout "$secs" bash -c "$*" 2>&1 | quiet | tail -${TAIL:-25}
    echo "-- $name exit ${PIPESTATUS[0]} (124: cut by its timeout)")
}

# FP8_GIN: decode_profile_gpu.py options of the fp8 profiles (sessions 41-43): bf16 weights and
# attention, V4's FP8 KV rows, fp8 indexer scores, input repeat 0.3 (PROFILE_GIN=$FP8_GIN)
FP8_GIN="--gin \"model_preset.weight_dtype='bf16'\" \
  --gin \"model_preset.attention_precision='bf16'\" --gin \"model_preset.kv_dtype='fp8_v4'\" \
  --gin \"model_preset.score_precision='fp8'\" --input-repeat 0.3"

# profile NAME CONTEXT BATCH SECONDS: benchmarks/decode_profile_gpu.py's decode profile of
# $METHODS (default hisparse and leansparse_fp8_jt) at bf16 matmuls, with the HLO census, as
# part NAME (prefills cached in /tmp/lsparse_scale_prefill while the machine stays warm);
# PROFILE_GIN: more --gin options for decode_profile_gpu.py (e.g. --gin \"model_preset.x='y'\")
profile() {  # profile NAME CONTEXT BATCH SECONDS
  TAIL=40 part "$1" "$4" "python3 benchmarks/decode_profile_gpu.py \
    --methods ${METHODS:-hisparse,leansparse_fp8_jt} --context $2 --batch $3 --hlo-census \
    --gin \"model_preset.matmul_precision='bf16'\" --prefill-cache /tmp/lsparse_scale_prefill \
    ${PROFILE_GIN:-} --out \$OUT --budget-s $(( $4 - 10 ))"
}

# variants NAME SET ROUNDS SECONDS: benchmarks/launch_variants_gpu.py --set SET as part NAME
# (LV_ARGS: more options, e.g. "--busy 3")
variants() {
  TAIL=40 part "$1" "$4" "python3 benchmarks/launch_variants_gpu.py --set $2 --rounds $3 \
    --out \$OUT --budget-s $(( $4 - 20 )) ${LV_ARGS:-}"
}

# pack NAME: everything under $OUT into $OUT/NAME.tar (the device tool returns few files)
pack() {
  (cd "$OUT" && tar -cf "/tmp/$1.tar" . && find . -mindepth 1 -delete && mv "/tmp/$1.tar" .)
  ls -la "$OUT"
}

# spec NAME PRECISION IMPLEMENTATION [SECONDS]: speculative_v4.gin's hisparse C8 cell at that
# matmul precision and kernel implementation, with the plain logit margins recorded (where its
# greedy tokens depart from plain decoding); SECONDS defaults to $SPEC_S, else 140.
spec() {
  TAIL=4 part "$1" "${4:-${SPEC_S:-140}}" "python3 -m experiments.cli run configs/experiments/speculative_v4.gin \
    \"--gin.speculative.methods=('hisparse',)\" \"--gin.model_preset.matmul_precision='$2'\" \
    \"--gin.speculative.implementation='$3'\" --gin.speculative.results_dir=None \
    --gin.speculative.record_margins=True \
    \"--gin.run.name='$1'\""
}

# capacity RUN: configs/experiments/RUN.gin at CONTEXTS (default "(524288,)"), resumed from
# results/RUN/results.json when there is one (copy $OUT/capacity/RUN/results.json there after
# each call), as part "capacity" (CAPACITY_S seconds, default 560)
capacity() {
  mkdir -p "$OUT/capacity/$1"
  [ -f "results/$1/results.json" ] && cp "results/$1/results.json" "$OUT/capacity/$1/"
  TAIL=40 part capacity ${CAPACITY_S:-560} "python3 -m experiments.cli run \
    configs/experiments/$1.gin \"--gin.capacity.time_contexts=${CONTEXTS:-(524288,)}\""
}
