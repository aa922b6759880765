"""Host time per decode step of the engine's launch path, on a model small enough that the
host's work dominates (the regime of the H200 decode step at batch 1-8, where the device
waited 1.5-1.9 ms at each step's start for the host's dispatches: session 28's profile,
``results/decode_profile_b1_b8/``).

    python3 benchmarks/launch_overhead.py [--methods hisparse,leansparse] [--out DIR]

Per method: the tiny preset (64 hidden, 2 heads, 256 tokens), 3 slots with 2 requests,
``Engine.decode(10)`` after 2 warm calls, median and spread of ``--rounds`` calls, ms per
step; and the number of compilations of ``steps.launch_step`` (``programs``, 1: the first step of a
``decode`` call, launched with no step in flight, shares the pipelined steps' program).
Writes launch_overhead.json to --out when given. Any machine (CPU included).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import numpy as np

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import preset
from lsparse_jax.model.transformer import init_params
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import launch_step


def engine(method: str) -> Engine:
    cfg = preset("tiny", max_len=256, hca_ratio=16, swa_window=8, hidden=64, num_heads=2,
                 head_dim=32, mlp_hidden=64)
    params = init_params(cfg, 5)
    books = None
    if method == "leansparse":
        calib = np.random.default_rng(7).integers(0, 256, 400).astype(np.int32)
        books = calibrate_codebooks(params, cfg, calib, iters=2)
    cache = CacheConfig(num_slots=3, prefill_chunk=32, page_size=4,
                        hot_cache_rows=None if method == "resident" else 16,
                        optional_pages=6 if method == "adaptive" else None, refill_pages=2)
    lean = LeanSparseConfig(num_candidates=32, key_cache_rows=64)
    eng = Engine(EngineConfig(model=cfg, cache=cache, method=method, leansparse=lean), params,
                 books)
    rng = np.random.default_rng(3)
    for n in (41, 70):
        eng.admit(rng.integers(0, 256, n).astype(np.int32), max_new_tokens=120)
    return eng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="resident,hisparse,leansparse,adaptive")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for method in a.methods.split(","):
        eng = engine(method)
        before = launch_step._cache_size()
        eng.decode(2)
        eng.decode(10)
        jax.block_until_ready(eng.state)
        ms = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            eng.decode(10)
            ms.append((time.perf_counter() - t) / 10 * 1e3)
        rows.append(dict(method=method, ms_per_step=statistics.median(ms), min=min(ms),
                         max=max(ms), programs=launch_step._cache_size() - before))
        print(f"{method:12s} {rows[-1]['ms_per_step']:.3f} ms/step (min {min(ms):.3f}, "
              f"max {max(ms):.3f}); launch_step programs {rows[-1]['programs']}")
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "launch_overhead.json").write_text(json.dumps(
            {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
