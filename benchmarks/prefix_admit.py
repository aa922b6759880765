"""A continuation's admission from its prefix (``Engine.admit(prefix=...)``), by method: seconds
for the whole admission, for loading the prefix's layers (``PrefixLoad.load``: the saved state
and the host pages read back) and for the per-layer ``admit_layer`` calls (paging out, PQ
codes); the rest is the suffix's prefill and the first token.

Run (CPU, the session-14 setting): JAX_PLATFORMS=cpu python benchmarks/prefix_admit.py
GPU, the replay's V4-Flash slice (``configs/experiments/replay.gin``'s shapes and caches):
  python3 benchmarks/prefix_admit.py --preset v4_flash --prefix 131072 --suffix 2048 \
      --chunk 4096 --page 64 --implementation triton --out $OUT
Each method admits a prompt, decodes 4 tokens, detaches, and admits prompt + response +
suffix from the prefix; the last of ``--repeats`` admissions is reported (compiles excluded).
The split waits for each timed call, so the next layer's load no longer overlaps this layer's
compute: the total is an upper bound of an untimed admission's (compare methods alike).
Writes ``prefix_admit.json`` to --out when given (after every method). Session-14 CPU
figures (RESULTS.md "Session 14", 2 cores, jax 0.12.0.1, tiny at max_len 8192, 6000 + 300
tokens): hisparse 0.104 s (admit_layer 0.088), echo 0.095 (0.078), leansparse 0.301 (0.278).
"""

import argparse
import time

import jax
import numpy as np
from timing import write_results  # benchmarks/timing.py

import lsparse_jax.serving.engine as engine_module
import lsparse_jax.serving.prefix as prefix_module
from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params, preset
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.request import Request

# the replay's per-method caches (configs/experiments/replay.gin)
HOT = {"leansparse": 2048, "echo": 512, "hisparse": 4096}


def timed(spent, key, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*a, **kw))
        spent[key] += time.perf_counter() - t
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "v4_flash"])
    ap.add_argument("--prefix", type=int, default=6000)
    ap.add_argument("--suffix", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--implementation", default="xla")
    ap.add_argument("--methods", default="hisparse,echo,leansparse")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.preset == "tiny":  # the session-14 setting
        cfg = preset("tiny", max_len=8192)
        hot, lean, pool = dict.fromkeys(HOT, 64), LeanSparseConfig(64, 1.0, 128), 4096
    else:  # the replay's V4-Flash slice
        cfg = fit_max_len(preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"),
                                 matmul_precision="bf16", kv_dtype="fp8_v4"),
                          args.prefix + args.suffix + 64)
        hot, lean, pool = HOT, LeanSparseConfig(2048, 1.0, 4096), 65536
    if args.prefix + args.suffix + 8 > cfg.max_len:
        raise SystemExit(f"--prefix + --suffix must fit max_len={cfg.max_len}")
    params = init_params(cfg, 0)
    vocab = min(cfg.vocab_size, 256)
    calib = np.random.default_rng(1).integers(0, vocab, 4 * args.chunk).astype(np.int32)
    books = calibrate_codebooks(params, cfg, calib, subspace_dim=lean.pq_subspace_dim,
                                iters=4)
    spent = {"admit_layer": 0.0, "prefix_load": 0.0}
    engine_module.admit_layer = timed(spent, "admit_layer", engine_module.admit_layer)
    prefix_module.PrefixLoad.load = timed(spent, "prefix_load", prefix_module.PrefixLoad.load)
    results = []
    for method in args.methods.split(","):
        cache = CacheConfig(2, args.chunk, hot[method], args.page,
                            streamed_prefill=method == "leansparse",
                            shared_pool_rows=pool if method == "echo" else None)
        engine = engine_module.Engine(
            EngineConfig(model=cfg, method=method, cache=cache, sampling=SamplingConfig(0.0),
                         leansparse=lean, implementation=args.implementation),
            params, books if method == "leansparse" else None)
        engine.warmup()
        rng = np.random.default_rng(2)
        for _ in range(args.repeats):
            prompt = rng.integers(0, vocab, args.prefix).astype(np.int32)
            first = Request(prompt, 4)
            slot = engine.admit(first)
            while not first.done:
                engine.step()
            prefix = engine.detach(slot)
            nxt = np.concatenate([prompt, np.asarray(first.tokens[:-1], np.int32),
                                  rng.integers(0, vocab, args.suffix).astype(np.int32)])
            spent.update(admit_layer=0.0, prefix_load=0.0)
            t = time.perf_counter()
            slot = engine.admit(Request(nxt, 2), prefix=prefix)
            jax.block_until_ready(engine.state)
            total = time.perf_counter() - t
            engine.release(slot)
        row = {"method": method, "admission_s": total, "prefix_load_s": spent["prefix_load"],
               "admit_layer_s": spent["admit_layer"],
               "rest_s": total - spent["prefix_load"] - spent["admit_layer"]}
        results.append(row)
        print(f"{method:<11} admission {total:.3f} s: prefix load {row['prefix_load_s']:.3f}, "
              f"admit_layer {row['admit_layer_s']:.3f}, rest {row['rest_s']:.3f}", flush=True)
        del engine
        write_results(args.out, "prefix_admit.json", args, results)


if __name__ == "__main__":
    main()
