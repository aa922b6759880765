"""Where the time of a long prefill goes: V4-Flash 4-layer slice, one prompt of --context
tokens prefilled in --chunk chunks; the last two chunks run under jax.profiler and the per-op
GPU time of one chunk is printed (op, ms, share). Writes --out/prefill_trace.json.gz and
--out/prefill_ops.json.

  python3 benchmarks/prefill_profile_gpu.py --context 131072 --out $OUT
  (--implementation triton: the chunk's kernels, with --precision bf16 the indexer's scores
  through the index_logits kernel; default xla)
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from lsparse_jax.model import init_params, preset
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.steps import forward_chunk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--precision", choices=("highest", "tf32", "bf16"), default="highest",
                    help="ModelConfig.matmul_precision")
    ap.add_argument("--implementation", choices=("xla", "triton"), default="xla",
                    help="the chunk's kernels (forward_chunk's implementation)")
    ap.add_argument("--out", default="/tmp/prefill_profile")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = fit_max_len(preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"),
                             matmul_precision=args.precision), args.context)
    params = init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, args.context), jnp.int32)
    caches, chunk = empty_cache(cfg), args.chunk
    starts = list(range(0, args.context, chunk))
    t0 = time.perf_counter()
    for start in starts[:-2]:
        _, caches, _ = forward_chunk(params, cfg, caches, tokens[start:start + chunk], start,
                                     chunk, implementation=args.implementation)
    jax.block_until_ready(caches)
    print(f"prefill of {starts[-2]} tokens: {time.perf_counter() - t0:.1f} s (incl. compile)")
    trace = out / "prefill_trace_dir"  # its own folder: rglob must find only this trace
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        for start in starts[-2:]:
            _, caches, _ = forward_chunk(params, cfg, caches, tokens[start:start + chunk],
                                         start, chunk, implementation=args.implementation)
        jax.block_until_ready(caches)
    f = next(trace.rglob("*.trace.json.gz"))
    shutil.copy(f, out / "prefill_trace.json.gz")
    shutil.rmtree(trace)
    ev = json.load(gzip.open(out / "prefill_trace.json.gz"))["traceEvents"]
    gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"]["name"]}
    dur = collections.Counter()
    for e in ev:
        if e.get("ph") == "X" and e["pid"] in gpu:
            dur[e["name"][:80]] += e["dur"] / 2 / 1e3  # ms per chunk
    total = sum(dur.values())
    rows = [{"op": k, "ms_per_chunk": v, "share": v / total} for k, v in dur.most_common(30)]
    (out / "prefill_ops.json").write_text(json.dumps({"context": args.context, "chunk": chunk,
                                                      "precision": args.precision,
                                                      "implementation": args.implementation,
                                                      "gpu_ms_per_chunk": total,
                                                      "ops": rows}, indent=1))
    print(f"GPU time per chunk at the end of {args.context} tokens: {total:.1f} ms")
    for r in rows[:20]:
        print(f"{r['ms_per_chunk']:9.2f} ms  {r['share']:6.1%}  {r['op']}")


if __name__ == "__main__":
    main()
