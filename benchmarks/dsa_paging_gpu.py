"""Paged GLM-5-style DSA layers on the GPU (issue 15 item 5): decode-step time of an 8-layer
slice of the glm5 preset (share groups of 4) with DSA rows resident vs paged (hisparse,
members following the leader's location vector), greedy tokens compared, and the device /
host bytes per request from ``memory.accounting.request_bytes``.

Run on the GPU machine (bounded: stops starting new cells after --budget-s seconds):
    python benchmarks/dsa_paging_gpu.py                 # 16K context, batch 4 (not yet run)
CPU smoke (tiny shapes):
    JAX_PLATFORMS=cpu python benchmarks/dsa_paging_gpu.py --smoke

Random weights; implementation "triton" on the GPU ("xla" in the smoke run); page size 64 (a
page id = 256 tokens of every DSA layer), hot cache B = 4096 rows (2 x top-k 2048). Per cell:
``--batch`` copies of one prefill, 3 warm steps, then two timed passes of ``--steps`` / 2 decode
steps each (wall time around ``Engine.step``); ``step_ms`` is the second pass (``pass_ms`` both:
in session 8 a first cell's timed steps still compiled). Writes dsa_paging_gpu.json under --out
(default $OUT or results/dsa_paging) after every cell and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax
import numpy as np

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.model import init_params
from lsparse_jax.model.presets import fit_max_len, preset
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import prefill


def model(args):
    if args.smoke:
        cfg = preset("tiny", layer_pattern=("dsa",) * 8, dsa_share_group=4, hidden=64,
                     num_heads=2, head_dim=32, mlp_hidden=64)
    else:
        cfg = preset("glm5", layer_pattern=("dsa",) * 8, matmul_precision="bf16")
    return fit_max_len(cfg, args.context + args.steps + 8)


def cell(cfg, params, prompt, prefilled, method, args, reuse=True):
    rows = None if method == "resident" else 2 * cfg.indexer.top_k
    engine = Engine(EngineConfig(
        model=cfg, method=method, implementation="xla" if args.smoke else "triton",
        cache=CacheConfig(num_slots=args.batch, prefill_chunk=args.chunk,
                          hot_cache_rows=rows, page_size=args.page, location_reuse=reuse)),
        params)
    for _ in range(args.batch):
        engine.admit(prompt, args.steps + 4, prefilled=prefilled)
    for _ in range(3):
        engine.step()
    jax.block_until_ready(engine.state)
    passes = []  # two timed passes: a first pass may still compile (session 8's 741 ms cell)
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(args.steps // 2):
            engine.step()
        jax.block_until_ready(engine.state)
        passes.append((time.perf_counter() - t0) / (args.steps // 2) * 1e3)
    step_ms = passes[-1]
    acc = request_bytes(engine.config, args.context + args.steps + 4)
    sel = engine.metrics()["selection"]
    out = {"method": method, "location_reuse": reuse, "context": args.context,
           "batch": args.batch, "step_ms": step_ms, "pass_ms": passes,
           "gpu_bytes_per_request": acc.gpu_total,
           "host_bytes_per_request": acc.host_total, "host_rows": sel["host_rows"],
           "tokens": engine.generated[0]}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--chunk", type=int, default=1024)  # a chunk's gathered rows: T*k*D*4 B
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--out", default=os.environ.get("OUT", "results/dsa_paging"))
    args = p.parse_args()
    if args.smoke:
        args.context, args.batch, args.steps, args.chunk, args.page = 200, 2, 4, 64, 8
    t_start = time.perf_counter()
    cfg = model(args)
    params = init_params(cfg, 0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.context).astype(np.int32)
    prefilled = jax.block_until_ready(prefill(params, cfg, prompt, args.chunk))  # admitted B times
    prefill_s = time.perf_counter() - t_start
    print(f"prefill (compile included) {prefill_s:.1f} s; --budget-s counts from here", flush=True)
    t_start = time.perf_counter()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for method, reuse in (("resident", True), ("hisparse", True), ("hisparse", False)):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget of {args.budget_s} s spent: skipping {method} reuse={reuse}")
            continue
        results.append(cell(cfg, params, prompt, prefilled, method, args, reuse))
        (out_dir / "dsa_paging_gpu.json").write_text(json.dumps(results, indent=1))
    if not results:
        raise SystemExit("no cell ran within --budget-s")
    ref = results[0]["tokens"]
    print(f"{'method':<10}{'reuse':>6}{'step ms':>9}{'GPU MB/req':>11}{'host MB/req':>12}"
          f"{'host rows':>10}{'tokens=':>8}")
    for r in results:
        print(f"{r['method']:<10}{r['location_reuse']!s:>6}{r['step_ms']:>9.2f}"
              f"{r['gpu_bytes_per_request'] / 2**20:>11.1f}"
              f"{r['host_bytes_per_request'] / 2**20:>12.1f}{r['host_rows']:>10.0f}"
              f"{r['tokens'] == ref!s:>8}")


if __name__ == "__main__":
    main()
