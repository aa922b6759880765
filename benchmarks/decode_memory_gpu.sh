#!/usr/bin/env bash
# Issue 13: why the 1M cells at batch 64 ran out of memory (session 25: a 32 GiB host
# allocation inside jit_decode_step, f32 rows). The scale grid at 64K, batch 8, with
# scale.memory_analysis = True: each record's `decode_memory` holds XLA's buffer sizes of the
# compiled decode step (device and pinned_host: argument, output, alias, temp) beside the
# state's own bytes. A state aliased whole gives alias + host_alias == state bytes; a host
# temp or unaliased host output the size of a pool is the second copy. Then the same with
# fp8_v4 rows (hisparse). One device call (carry [".whl"]; session 25: 153.6 s wall,
# results/decode_memory/); results under $OUT.
source "$(dirname "$0")/gpu_lib.sh"
grid() {  # NAME SECONDS EXTRA-GIN...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m experiments.cli run configs/experiments/scale_batch.gin \
    "--gin.run.name='$name'" "--gin.scale.contexts=(65536,)" "--gin.scale.batches=(8,)" \
    --gin.scale.batches_by_context=None --gin.scale.memory_analysis=True \
    --gin.scale.prefill_cache=None --gin.scale.steps=4 "$@" 2>&1 | quiet | grep '^{'
  python3 - "$OUT/$name/results.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    m = r.get("decode_memory", {})
    gib = lambda k: f"{m.get(k, 0) / 2**30:7.3f}"
    print(f"{r['method']:10s} state {gib('state_bytes')} host {gib('state_host_bytes')} | "
          f"alias {gib('alias_bytes')} host_alias {gib('host_alias_bytes')} | out "
          f"{gib('output_bytes')} host_out {gib('host_output_bytes')} | temp {gib('temp_bytes')}"
          f" host_temp {gib('host_temp_bytes')} GiB", r.get("error", ""))
PY
}
grid decode_memory_f32 150 "--gin.scale.methods=('hisparse','resident','leansparse')"
grid decode_memory_fp8 90 "--gin.scale.methods=('hisparse',)" \
  "--gin.model_preset.kv_dtype='fp8_v4'"
