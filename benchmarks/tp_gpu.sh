#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (issue 18), one device call of about 200 s (device tool:
# carry [".whl"], kind nvidia-h200-x2); every part time-limited, in order of importance:
#   1. identity  tp=2 vs tp=1 on the GPU kernels (tests/tp_identity.py, tiny model): greedy
#                tokens, selections, largest logit difference, a line per method as it
#                finishes                                                    -> $OUT/tp_identity.json
#   2. study     experiments/tp.py (configs/experiments/tp.gin) at 512K, B=64, methods in the
#                order leansparse, hisparse, resident, adaptive, each on 1 then 2 GPUs: decode
#                step time and capacity at 100 GiB per GPU, random caches of the context's
#                shapes instead of the ~70 s prefill                          -> $OUT/tp/results.json
# results.json is rewritten after every cell (a part cut by its timeout keeps its cells; a
# rerun resumes). The last lines printed are a table of every cell and the 2-vs-1 ratios.
# Knobs: TP_METHODS, TP_BATCHES, TP_CONTEXTS (gin tuples), TP_IMPL (default triton),
# TP_IDENTITY_S / TP_STUDY_S (part timeouts, default 50 / 110 s), TP_EXTRA (more --gin.X=Y
# arguments of the study, split on spaces; a CPU dry run: TP_EXTRA="--gin.model_preset.name='tiny'
# --gin.tp.hot_cache_rows=32 --gin.tp.page_size=8 --gin.tp.prefill_chunk=128
# --gin.LeanSparseConfig.num_candidates=32 --gin.LeanSparseConfig.key_cache_rows=48").
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# every device keeps its own pinned_host copy of the host pools (lsparse_jax/parallel.py)
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-160}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LSPARSE_RUNS=$OUT
METHODS=${TP_METHODS:-"('leansparse', 'hisparse', 'resident', 'adaptive')"}
BATCHES=${TP_BATCHES:-"(64,)"}
CONTEXTS=${TP_CONTEXTS:-"(524288,)"}
IMPL=${TP_IMPL:-triton}
STUDY_S=${TP_STUDY_S:-110}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "== 1. identity tp=2 vs tp=1 ($IMPL kernels)"
timeout "${TP_IDENTITY_S:-50}" python3 -m tests.tp_identity leansparse hisparse resident \
  adaptive --implementation "$IMPL" --steps 3 > "$OUT/tp_identity.json" \
  2> "$OUT/tp_identity.err" || { echo "identity: exit $?"; grep -v Warning "$OUT/tp_identity.err" | tail -4; }

echo "== 2. study: $CONTEXTS B=$BATCHES"
timeout "$STUDY_S" python3 -m experiments.cli run configs/experiments/tp.gin \
  "--gin.tp.implementation='$IMPL'" "--gin.tp.contexts=$CONTEXTS" "--gin.tp.batches=$BATCHES" \
  "--gin.tp.methods=$METHODS" "--gin.tp.time_limit_s=$((STUDY_S - 30))" \
  --gin.tp.random_caches=True --gin.tp.calibration_tokens=2048 ${TP_EXTRA:-} 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]" | grep '^{\|rror' | tail -12 || echo "study: exit $?"

echo "== summary"
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
ident = out / "tp_identity.json"
if ident.exists() and ident.read_text().strip():
    lines = [json.loads(x) for x in ident.read_text().splitlines() if x.startswith("{")]
    for m, r in ((m, r) for line in lines for m, r in line.items()):
        print(f"identity {m:10s} tokens_equal={r['tokens'][0] == r['tokens'][1]} "
              f"selections_equal={r['same_selection']} max_logit_diff={max(r['logit_diff']):.2e}")
res = out / "tp" / "results.json"
if not res.exists():
    sys.exit("no tp results")
data = json.loads(res.read_text())
print(f"{'method':10s} {'dev':>3s} {'context':>7s} {'B':>3s} {'step_ms':>8s} {'max_conc':>8s}")
for r in data["records"]:
    step = f"{r['step_ms']:.2f}" if "step_ms" in r else r.get("skipped", r.get("error", ""))[:40]
    print(f"{r['method']:10s} {r['devices']:3d} {r['context']:7d} {r['batch']:3d} {step:>8s} "
          f"{r.get('max_concurrency', '-'):>8}")
for r in data["records"]:
    if "error" in r:
        print(f"error {r['method']} devices={r['devices']}: {r['error']}")
for s in data["scaling"]:
    print(f"scaling {s['method']:10s} {s['context']:7d} B={s['batch']} devices={s['devices']}: "
          f"step {s['step_ratio']:.2f}x, capacity {s['capacity_ratio']:.2f}x")
EOF
