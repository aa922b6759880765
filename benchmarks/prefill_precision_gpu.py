"""Prefill time by ``ModelConfig.matmul_precision``, top-k implementation (the exact
selections' ``topk`` op: "xla" = lax.top_k, "triton" = the Pallas kernel) and chunk size:
V4-Flash 4-layer slice (swa, csa, hca, csa), random weights, one random-token prompt per
context, timed after a one-chunk warm-up compile. For each non-reference precision also the last
prompt token's logits against "highest" (max abs difference over max abs logit, argmax
agreement) where both were run; for each non-"xla" implementation whether its logits equal the
"xla" run's bit for bit (same precision and chunk).

  python3 benchmarks/prefill_precision_gpu.py --contexts 131072 --precisions highest,tf32,bf16 \
      --out $OUT
  python3 benchmarks/prefill_precision_gpu.py --contexts 131072 --precisions bf16 \
      --implementations xla,triton --chunks 4096,8192 --out $OUT

Writes --out/prefill_precision.json (appends records when the file exists) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import numpy as np

from lsparse_jax.model import init_params, preset
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.steps import prefill


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--precisions", default="highest,tf32,bf16")
    ap.add_argument("--chunks", default="4096")
    ap.add_argument("--implementations", default="xla")
    ap.add_argument("--out", default="/tmp/prefill_precision")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prefill_precision.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    base = preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"))
    for context in map(int, args.contexts.split(",")):
        prompt = np.random.default_rng(context).integers(0, 256, context).astype(np.int32)
        ref, same = None, {}
        for name in args.precisions.split(","):
            cfg = fit_max_len(dataclasses.replace(base, matmul_precision=name), context)
            params = init_params(cfg, 0)
            for chunk in map(int, args.chunks.split(",")):
                for impl in args.implementations.split(","):
                    t0 = time.perf_counter()
                    jax.block_until_ready(prefill(params, cfg, prompt[:chunk], chunk,
                                                  implementation=impl))
                    compile_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    _, logits = jax.block_until_ready(prefill(params, cfg, prompt, chunk,
                                                              implementation=impl))
                    seconds = time.perf_counter() - t0
                    logits = np.asarray(logits, np.float64)
                    rec = {"context": context, "precision": name, "implementation": impl,
                           "prefill_s": seconds, "tokens_per_s": context / seconds,
                           "warmup_s": compile_s, "chunk": chunk,
                           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
                    if name == "highest" and ref is None:
                        ref = logits
                    elif ref is not None:
                        rec["logit_rel_err"] = float(np.max(np.abs(logits - ref))
                                                     / np.max(np.abs(ref)))
                        rec["argmax_equal"] = bool(np.argmax(logits) == np.argmax(ref))
                    if impl == "xla":
                        same[name, chunk] = logits
                    elif (name, chunk) in same:
                        rec["logits_equal_xla"] = bool(np.array_equal(logits, same[name, chunk]))
                    records.append(rec)
                    path.write_text(json.dumps({"records": records}, indent=1))
                    print(json.dumps(rec), flush=True)
    print(f"\n{'context':>8} {'precision':>9} {'impl':>7} {'chunk':>6} {'prefill s':>10} "
          f"{'tok/s':>9} {'rel err':>9} {'=xla':>5}")
    for r in records:
        print(f"{r['context']:>8} {r['precision']:>9} {r.get('implementation', 'xla'):>7} "
              f"{r['chunk']:>6} {r['prefill_s']:>10.2f} {r['tokens_per_s']:>9.0f} "
              f"{r.get('logit_rel_err', float('nan')):>9.2e} "
              f"{str(r.get('logits_equal_xla', '')):>5}")


if __name__ == "__main__":
    main()
