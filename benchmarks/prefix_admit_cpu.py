"""A continuation's admission from its prefix (``Engine.admit(prefix=...)``) on CPU, by method:
seconds for the whole admission and for its per-layer ``admit_layer`` calls.

Run: JAX_PLATFORMS=cpu python benchmarks/prefix_admit_cpu.py [--prefix 6000] [--suffix 300]
Tiny preset at max_len 8192, random weights, 2 slots, 512-token chunks; each method admits a
prompt, decodes 4 tokens, detaches, and admits prompt + response + suffix from the prefix (the
third repetition is printed, compiles excluded). The session-14 figures (RESULTS.md "Session
14", 2 cores, jax 0.12.0.1): hisparse 0.104 s (admit_layer 0.088), echo 0.095 (0.078),
leansparse 0.301 (0.278).
"""

import argparse
import time

import jax
import numpy as np

import lsparse_jax.serving.engine as engine_module
from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig, SamplingConfig
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params, preset
from lsparse_jax.serving.request import Request

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=6000)
    ap.add_argument("--suffix", type=int, default=300)
    args = ap.parse_args()
    cfg = preset("tiny", max_len=8192)
    params = init_params(cfg, 0)
    calib = np.random.default_rng(1).integers(0, 256, 1024).astype(np.int32)
    books = calibrate_codebooks(params, cfg, calib, iters=4)
    spent = {"admit_layer": 0.0}
    admit_layer = engine_module.admit_layer

    def timed_admit_layer(*a, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(admit_layer(*a, **kw))
        spent["admit_layer"] += time.perf_counter() - t
        return out

    engine_module.admit_layer = timed_admit_layer
    for method in ("hisparse", "echo", "leansparse"):
        cache = CacheConfig(2, 512, 64, 16, streamed_prefill=method == "leansparse",
                            shared_pool_rows=4096 if method == "echo" else None)
        engine = engine_module.Engine(
            EngineConfig(model=cfg, method=method, cache=cache, sampling=SamplingConfig(0.0),
                         leansparse=LeanSparseConfig(num_candidates=64, key_cache_rows=128)),
            params, books if method == "leansparse" else None)
        engine.warmup()
        rng = np.random.default_rng(2)
        for _ in range(3):
            prompt = rng.integers(0, 256, args.prefix).astype(np.int32)
            first = Request(prompt, 4)
            slot = engine.admit(first)
            while not first.done:
                engine.step()
            prefix = engine.detach(slot)
            nxt = np.concatenate([prompt, np.asarray(first.tokens[:-1], np.int32),
                                  rng.integers(0, 256, args.suffix).astype(np.int32)])
            spent["admit_layer"] = 0.0
            t = time.perf_counter()
            slot = engine.admit(Request(nxt, 2), prefix=prefix)
            jax.block_until_ready(engine.state)
            total = time.perf_counter() - t
            engine.release(slot)
        print(f"{method:<11} admission {total:.3f} s, admit_layer {spent['admit_layer']:.3f} s")
