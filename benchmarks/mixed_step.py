"""A mixed iteration (``serving.mixed``: one prefill chunk inside the decode step) against the
same work as two programs (the decode step, then the chunk alone), by method.

Each method admits ``--batch`` copies of one ``--context``-token prefill and then times, per
iteration (median of ``--repeats`` after 2 warm ones; every timing waits for its results):
  step     ``Engine.step()``: the decode step of every slot, tokens read back
  chunk    one ``--chunk``-token prefill chunk at position 0 alone (``steps.PrefillChunks``)
  mixed    ``Engine.step(prefill=...)``: both in one jitted program
and reports mixed / (step + chunk). What the fused program can save: one dispatch and, per
layer, the MLP's and the LM head's weight reads for the decode rows (they ride on the
chunk's); the attention of each path is unchanged.

Run (CPU smoke): JAX_PLATFORMS=cpu python benchmarks/mixed_step.py
GPU, the V4-Flash slice (bf16 matmuls, FP8 V4 rows, Triton kernels):
  python3 benchmarks/mixed_step.py --preset v4_flash --context 32768 --batch 16 \
      --chunk 4096 --page 64 --implementation triton --out $OUT
Writes ``mixed_step.json`` to --out (after every method).
"""

import argparse
import time

import jax
import numpy as np
from timing import write_results  # benchmarks/timing.py

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params, preset
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import prefill, prefill_chunks


def median_s(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def time_method(cfg, params, books, method, lean, hot, pre, prompt, chunk_prompt, steps,
                args) -> dict:
    """One method's step, chunk and mixed times (module docstring)."""
    paged = method != "resident"
    cache = CacheConfig(args.batch, args.chunk, hot if paged else None, args.page)
    engine = Engine(EngineConfig(model=cfg, method=method, cache=cache,
                                 sampling=SamplingConfig(0.0), leansparse=lean,
                                 implementation=args.implementation), params, books)
    engine.warmup()
    for _ in range(args.batch):
        engine.admit(Request(prompt, steps), prefilled=pre)

    def fresh():  # the chunk's prompt from its first chunk (position 0)
        return prefill_chunks(engine.params, cfg, chunk_prompt, args.chunk, args.implementation)

    step = median_s(engine.step, args.repeats)
    chunk = median_s(lambda: jax.block_until_ready(next(fresh())), args.repeats)
    mixed = median_s(lambda: engine.step(prefill=fresh()), args.repeats)
    return {"method": method, "step_ms": 1e3 * step, "chunk_ms": 1e3 * chunk,
            "mixed_ms": 1e3 * mixed, "mixed_over_separate": mixed / (step + chunk)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "v4_flash"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--hot", type=int, default=None, help="hot-cache rows (default: 2x top-k)")
    ap.add_argument("--implementation", default="xla")
    ap.add_argument("--methods", default="resident,hisparse,leansparse")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    steps = 3 * (args.repeats + 2) + 2
    base = (preset("tiny") if args.preset == "tiny" else
            preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"),
                   matmul_precision="bf16", kv_dtype="fp8_v4"))
    cfg = fit_max_len(base, max(args.context + steps + 1, args.chunk))
    params = init_params(cfg, 0)
    vocab = min(cfg.vocab_size, 256)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, args.context).astype(np.int32)
    chunk_prompt = rng.integers(0, vocab, args.chunk).astype(np.int32)
    t0 = time.perf_counter()
    pre = prefill(params, cfg, prompt, args.chunk, implementation=args.implementation)
    print(f"prefill of {args.context} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    lean = LeanSparseConfig(num_candidates=min(2048, 4 * cfg.indexer.top_k))
    hot = args.hot or 2 * cfg.indexer.top_k
    results = []
    for method in args.methods.split(","):
        books = None
        if method == "leansparse":
            books = calibrate_codebooks(params, cfg, prompt[:4 * args.chunk],
                                        subspace_dim=lean.pq_subspace_dim, iters=4)
        row = time_method(cfg, params, books, method, lean, hot, pre, prompt, chunk_prompt,
                          steps, args)
        results.append(row)
        print(f"{method:<11} step {row['step_ms']:.2f} ms  chunk {row['chunk_ms']:.2f} ms  "
              f"mixed {row['mixed_ms']:.2f} ms  mixed/(step+chunk) "
              f"{row['mixed_over_separate']:.3f}", flush=True)
        write_results(args.out, "mixed_step.json", args, results)


if __name__ == "__main__":
    main()
