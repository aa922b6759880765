#!/usr/bin/env bash
# Issue 17 on one H200, in device calls of < 9 minutes each:
#   STEP=train     configs/experiments/train_long.gin (checkpoints/long continued on the titled
#                  MRCR format: 1K dense, then 2K -> 16K sparse; 297 s on the H200 in session 12, which shipped it). Stops cleanly after TRAIN_SECONDS (default
#                  420) with its orbax state in runs/train_long/state; the next call resumes
#                  (same machine: runs/ stays; a fresh machine: carry runs/train_long, unpacked
#                  from $OUT/train_long_resume.tar). Finished: exports checkpoints/long and copies
#                  it to $OUT/checkpoints/long.
#   STEP=accuracy  configs/experiments/accuracy_long.gin on checkpoints/long (issue 17's table: NIAH
#                  then MRCR, 1K-16K, seven methods (five + the _pq2 remedy), 200 examples, one batch of 200 slots per
#                  cell), writes $OUT/accuracy_long/{results.json, table.md, accuracy.png},
#                  rewritten after every method of every cell. Resumes: a results.json in
#                  RESUME (default results/accuracy_long, i.e. the previous call's $OUT files
#                  copied there) keeps its finished (task, length, method) groups, and only the
#                  others run (the settings must match; complete=true: nothing left to run).
#                  Budget: no method starts after ACC_SECONDS (default 430) from the start of
#                  the experiment; ACC_TIMEOUT (500) kills it. Knobs: LENGTHS, TASKS, METHODS
#                  (gin tuples), EXAMPLES (200), SLOTS (200), SEED_OFFSET (1000000), ACC_EXTRA
#                  (more gin flags). Compiles (jax_log_compiles) go to
#                  $OUT/accuracy_long_compiles.log. The XLA compilation cache (runs/jaxcache)
#                  comes back as $OUT/jaxcache.tar: untar it into runs/ and carry runs/jaxcache
#                  so that a later call loads its compiled steps.
#   STEP=coldstart the cold-start measurement on checkpoints/long (100 examples, 4K-16K, NIAH,
#                  leansparse C64/C128 cold (warm_steps 0), warmed (1) and seeded at admission
#                  from the final prefill chunk's selections (_seed), per-step recall), writes
#                  $OUT/cold_start_long/ (~3-4 min estimated).
# Use through the device tool: carry [".whl"] (plus "runs/jaxcache" once a previous call's
# $OUT/jaxcache.tar is untarred into runs/), command "STEP=train bash benchmarks/train_long_gpu.sh".
# CPU smoke (no .whl): PY=/work/main/.venv/bin/python OUT=/tmp/o TRAIN_EXTRA='...' STEP=train ...
set -uo pipefail
PY=${PY:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" runs/jaxcache
# compiled steps survive a restarted call on the same machine (the curriculum compiles 8 shapes)
export JAX_COMPILATION_CACHE_DIR=$PWD/runs/jaxcache
case "${STEP:-train}" in
  train)
    timeout ${TRAIN_TIMEOUT:-$(( ${TRAIN_SECONDS:-420} + 100 ))} $PY -m experiments.cli run \
      configs/experiments/train_long.gin "--gin.train_model.max_seconds=${TRAIN_SECONDS:-420}" \
      ${TRAIN_EXTRA:-} 2>&1 | tr '\r' '\n' | sed -E 's/^train: +[0-9]+%\|[^]]*\]//' \
      | grep -v '^ *$' | tee "$OUT/train_long.log" | tail -40
    status=${PIPESTATUS[0]}  # the trainer's (124: killed by the timeout)
    mkdir -p "$OUT/train_long"
    cp runs/train_long/results.json runs/train_long/config.gin runs/train_long/loss.png \
      runs/train_long/history.json "$OUT/train_long/" 2>/dev/null
    EXPORT=${EXPORT:-checkpoints/long}
    if grep -q '"complete": true' runs/train_long/results.json 2>/dev/null; then
      mkdir -p "$OUT/checkpoints" && cp -r "$EXPORT" "$OUT/checkpoints/" && du -sh "$EXPORT"
      echo "TRAINING FINISHED: checkpoint in \$OUT/checkpoints/$(basename "$EXPORT")"
    elif [ ! -d runs/train_long/state ]; then
      echo "TRAINING FAILED (exit status $status) before its first checkpoint: see" \
        "\$OUT/train_long.log"
    else  # unfinished: the newest state step, in case the next call gets a fresh machine
      [ "$status" = 0 ] || echo "trainer exit status $status (124: killed by the timeout)"
      last=$(ls runs/train_long/state | grep -E '^[0-9]+$' | sort -n | tail -1)
      tar -C runs -cf "$OUT/train_long_resume.tar" "train_long/state/$last" \
        train_long/history.json
      echo "TRAINING UNFINISHED at step $last: rerun STEP=train (same machine: resumes from" \
        "runs/train_long; fresh machine: untar \$OUT/train_long_resume.tar into runs/ and carry" \
        "runs/train_long)"
    fi ;;
  accuracy)  # knobs (gin tuples as strings): LENGTHS, TASKS, METHODS, EXAMPLES, SLOTS, SEED_OFFSET
    RESUME=${RESUME:-results/accuracy_long}
    mkdir -p "$OUT/accuracy_long"
    if [ -f "$RESUME/results.json" ]; then  # the experiment keeps its finished groups
      cp "$RESUME/results.json" "$OUT/accuracy_long/results.json"
      echo "resuming from $RESUME/results.json"
    fi
    JAX_LOG_COMPILES=1 timeout ${ACC_TIMEOUT:-500} $PY -m experiments.cli run \
      configs/experiments/accuracy_long.gin --runs "$OUT" \
      "--gin.accuracy.lengths=${LENGTHS:-(1024,2048,4096,8192,16384)}" \
      "--gin.accuracy.tasks=${TASKS:-('niah','mrcr')}" \
      "--gin.accuracy.methods=${METHODS:-('resident','hisparse','leansparse_C64','leansparse_C128','direct_pq','leansparse_C64_pq2','leansparse_C128_pq2')}" \
      "--gin.accuracy.examples=${EXAMPLES:-200}" "--gin.accuracy.num_slots=${SLOTS:-200}" \
      "--gin.accuracy.seed_offset=${SEED_OFFSET:-1000000}" \
      "--gin.accuracy.max_seconds=${ACC_SECONDS:-430}" ${ACC_EXTRA:-} 2>&1 | tr '\r' '\n' \
      | grep -v "example/s\]" | tee "$OUT/accuracy_long_full.log" \
      | grep -v "compilation\|Compiling\|tracing\|jaxpr\|^ *$" | tee "$OUT/accuracy_long.log" \
      | tail -40
    grep "Finished XLA compilation" "$OUT/accuracy_long_full.log" \
      | sed -E 's/.*compilation of (.*) in ([0-9.]+) sec.*/\2 \1/' \
      > "$OUT/accuracy_long_compiles.log" && rm -f "$OUT/accuracy_long_full.log"
    echo "compiles: $(wc -l < "$OUT/accuracy_long_compiles.log"); slowest:"
    sort -rn "$OUT/accuracy_long_compiles.log" | head -8
    # results.json is rewritten after every method: a cut run keeps its finished groups
    python3 -c "import json; r=json.load(open('$OUT/accuracy_long/results.json')); print('complete', r['complete']); [print(c['task'], c['length'], c['method'], c['n'], round(c['exact'], 3), round(c['ci_low'], 3), round(c['ci_high'], 3)) for c in r['cells']]" 2>/dev/null
    # the compiled steps, for the next call on a fresh machine (carry runs/jaxcache)
    tar -C runs -cf "$OUT/jaxcache.tar" jaxcache && du -sh "$OUT/jaxcache.tar"
    ls -la "$OUT" "$OUT/accuracy_long" ;;
  coldstart)  # LeanSparse's cold start: cold, warmed, seeded; recall by decode step (teacher forced)
    timeout ${ACC_TIMEOUT:-400} $PY -m experiments.cli run configs/experiments/accuracy_long.gin \
      --runs "$OUT" "--gin.run.name='cold_start_long'" "--gin.accuracy.lengths=(4096,8192,16384)" \
      --gin.accuracy.examples=100 --gin.accuracy.num_slots=100 --gin.accuracy.recall=True \
      "--gin.accuracy.tasks=('niah',)" \
      "--gin.accuracy.methods=('resident','leansparse_C64_w0','leansparse_C64_w1','leansparse_C64_w0_seed','leansparse_C128_w0','leansparse_C128_w1','leansparse_C128_w0_seed')" \
      ${ACC_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "example/s\]" \
      | tee "$OUT/cold_start_long.log" | tail -25 ;;
  *) echo "STEP must be train, accuracy or coldstart" >&2; exit 2 ;;
esac
