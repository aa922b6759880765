"""Device page pools on the GPU (issue 13, deliver 3): decode-step time with pools vs the
preallocated layout, and how many requests of each method fit in one HBM budget.

Run on the GPU machine (H200; not yet run, so run time unknown: each timing cell compiles an
engine, 16-40 s each at these shapes per issue 13; split the grid to stay under a 10-minute
call):
    python benchmarks/pools_gpu.py --skip-timing                     # capacity only
    python benchmarks/pools_gpu.py --skip-capacity --contexts 32768 --tag 32k
    python benchmarks/pools_gpu.py --skip-capacity --contexts 131072 --tag 128k
  (--methods resident,hisparse narrows a call further; --budget-gb 100, --steps 16, --batch 8)
CPU smoke (tiny shapes, a few minutes on 2 cores):
    JAX_PLATFORMS=cpu python benchmarks/pools_gpu.py --smoke

Model: the v4_flash preset's 4-layer slice (swa, csa, hca, csa) with random weights, as
configs/experiments/scale.gin; implementation "triton"; HiSparse B = 4096, LeanSparse C = 2048
with a 4K key cache, page size 64.

1. timing: per method, context (32K, 128K) and layout ("preallocated": CacheConfig.device_pages
   None; "pools": device pools of exactly the batch's pages), B = 8 copies of one prefill; the
   mean of ``--steps`` decode steps after 4 warm steps (wall time around
   ``Engine.step``, which reads the tokens back). The pooled step's extra work: one gather of
   the slot's rows per read (exact keys [N_c] per CSA layer for resident/hisparse/adaptive,
   PQ codes [N_c] for leansparse, the k selected KV rows for resident, all HCA rows [N_h]
   for every method). Greedy tokens of both
   layouts are compared (identical = the pools changed nothing).
2. capacity: per method and context (128K, 512K), the requests whose device state fits in
   ``--budget-gb`` beside the slice's weights: with pools, each request holds its per-slot
   state (windows, compressor rings, tails, hot/key caches, page tables) plus ceil(N_c / 64)
   pages of every device pool (CSA rows, keys or codes, and HCA rows)
   (``memory.accounting.request_bytes``, tested byte for byte on CPU); preallocated, every
   slot holds the state of max_len = 1M tokens (the model's max_len). Adaptive's shared
   optional pool is not counted (one page here). The pools of the pooled count are then
   allocated on the device (proof they fit) and the controller's reservation is run until
   DeviceCapacityError (the count it admits).

Prints a table last and writes pools_gpu[_TAG].json under --out (default $OUT or
results/pools).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import jax
import numpy as np

from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_storage,
)
from lsparse_jax.memory.accounting import (
    device_page_bytes,
    max_concurrency,
    param_bytes,
    request_bytes,
)
from lsparse_jax.memory.device_pool import DeviceCapacityError, DevicePages
from lsparse_jax.methods import calibrate_codebooks, policy
from lsparse_jax.methods.base import pool_bytes
from lsparse_jax.model import init_params, preset
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import prefill

METHODS = ("resident", "hisparse", "leansparse", "adaptive")
WARM = 4


def settings(smoke: bool):
    if smoke:
        cfg = preset("tiny", layer_pattern=("swa", "csa", "hca", "csa"), hca_ratio=16)
        return dict(model=cfg, contexts=(256, 512), capacity=(512, 2048), hot=32, page=8,
                    lean=LeanSparseConfig(64, 1.0, 64), chunk=128, calib=256, max_len=4096,
                    implementation="xla")
    cfg = preset("v4_flash", layer_pattern=("swa", "csa", "hca", "csa"))
    return dict(model=cfg, contexts=(32768, 131072), capacity=(131072, 524288), hot=4096,
                page=64, lean=LeanSparseConfig(2048, 1.0, 4096), chunk=4096, calib=4096,
                max_len=1048576, implementation="triton")


def engine_config(cfg, method, s, batch, device_pages=None, optional=None):
    hot = s["hot"] if method_storage(method).kv_on_host else None
    cache = CacheConfig(batch, s["chunk"], hot, s["page"], optional_pages=optional,
                        device_pages=device_pages)
    return EngineConfig(model=cfg, cache=cache, sampling=SamplingConfig(0.0, 0), method=method,
                        leansparse=s["lean"], implementation=s["implementation"])


def codebooks(params, cfg, s, prompt, kind: str, seed: int) -> dict:
    """LeanSparse's codebooks: "calibrated" (k-means on the prompt's first keys, as scale.py)
    or "random" (normal centroids: no calibration forward pass; step time does not depend on
    codebook quality beyond the caches' hit rates, and both layouts get the same ones)."""
    if kind == "calibrated":
        return calibrate_codebooks(params, cfg, prompt[:s["calib"]],
                                   subspace_dim=s["lean"].pq_subspace_dim, iters=8, seed=seed)
    ds = s["lean"].pq_subspace_dim
    rng = np.random.default_rng(seed)
    return {i: rng.normal(size=(cfg.indexer.head_dim // ds, 256, ds)).astype(np.float32)
            for i, k in enumerate(cfg.layer_pattern) if k == "csa"}


def timing(s, batch, steps, warm, methods, contexts, books_kind, engine_warmup, over, save,
           seed=0) -> list[dict]:
    """Per context, per method: the preallocated then the pooled engine (a pair), while
    ``over()`` is False; ``save(records)`` after every cell."""
    out = []
    for context in contexts or s["contexts"]:
        if over():
            break
        cfg = fit_max_len(s["model"], context + steps + warm + 2)
        params = init_params(cfg, seed)
        prompt = np.random.default_rng(seed + context).integers(0, 256, context).astype(
            np.int32)
        t0 = time.perf_counter()
        pre = jax.block_until_ready(prefill(params, cfg, prompt, s["chunk"]))
        prefill_s = time.perf_counter() - t0  # compile included
        books = codebooks(params, cfg, s, prompt, books_kind, seed)
        total = context + steps + warm + 1
        for method in methods:
            optional = None
            if method == "adaptive":  # half the batch's complete prompt pages, as scale.py
                optional = max(1, batch * (context // cfg.csa_ratio // s["page"]) // 2)
            tokens = {}
            for layout in ("preallocated", "pools"):
                if over():
                    break
                pages = None
                if layout == "pools":
                    pages = batch * -(-(total // cfg.csa_ratio) // s["page"])
                config = engine_config(cfg, method, s, batch, pages, optional)
                rec = {"part": "timing", "method": method, "context": context, "batch": batch,
                       "layout": layout, "device_pages": pages, "steps": steps,
                       "prefill_s_with_compile": prefill_s, "codebooks": books_kind}
                try:
                    t0 = time.perf_counter()
                    eng = Engine(config, params, books)
                    if engine_warmup:
                        eng.warmup()
                    for _ in range(batch):
                        eng.admit(Request(prompt, max_new_tokens=steps + warm + 1),
                                  prefilled=pre)
                    for _ in range(warm):  # the first compiles the decode step
                        eng.step()
                    jax.block_until_ready(eng.state)
                    rec["setup_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        eng.step()
                    jax.block_until_ready(eng.state)
                    rec["step_ms"] = (time.perf_counter() - t0) / steps * 1e3
                    tokens[layout] = [list(g) for g in eng.generated]
                    rec["state_bytes"] = sum(a.nbytes for a in jax.tree.leaves(eng.state)
                                             if a.sharding.memory_kind != "pinned_host")
                    del eng
                except Exception as err:  # noqa: BLE001  (recorded; the grid goes on)
                    rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                out.append(rec)
                if len(tokens) == 2:
                    rec["tokens_identical"] = tokens["pools"] == tokens["preallocated"]
                print(json.dumps(rec), flush=True)
                save(out)
        del pre
    return out


def capacity(s, budget_gb, methods) -> list[dict]:
    out = []
    budget = int(budget_gb * 2**30)
    for context in s["capacity"]:
        cfg = fit_max_len(s["model"], context)
        weights = param_bytes(cfg)
        big = fit_max_len(s["model"], s["max_len"])  # the preallocated layout's max_len
        for method in methods:
            optional = 1 if method == "adaptive" else None  # lent pages: not counted here
            pooled = engine_config(cfg, method, s, 1, device_pages=1, optional=optional)
            per = request_bytes(pooled, context)
            n = max_concurrency(pooled, context, budget, weights)
            prealloc = engine_config(big, method, s, 1, optional=optional)
            n_pre = (budget - weights) // request_bytes(prealloc, big.max_len).gpu_total
            rec = {"part": "capacity", "method": method, "context": context,
                   "budget_gb": budget_gb, "weights_bytes": weights,
                   "per_request_bytes": per.gpu_total,
                   "pool_bytes_per_request": per.device_pages * device_page_bytes(pooled),
                   "pages_per_request": per.device_pages,
                   "device_page_bytes": device_page_bytes(pooled),
                   "max_concurrency": n, "max_concurrency_preallocated": int(n_pre),
                   "preallocated_max_len": big.max_len}
            try:  # allocate the pools of n requests on the device; reserve until full
                pages = max(1, n * per.device_pages)
                config = dataclasses.replace(pooled, cache=dataclasses.replace(
                    pooled.cache, device_pages=pages, num_slots=1))
                pools = jax.block_until_ready(policy(config).empty_pools())
                rec["allocated_pool_bytes"] = pool_bytes(pools)
                del pools
                ledger, admitted = DevicePages(pages, config.pages_per_slot), 0
                while True:
                    try:
                        ledger.reserve(admitted, per.device_pages, "a request")
                    except DeviceCapacityError:
                        break
                    admitted += 1
                rec["reserved"] = admitted
            except Exception as err:  # noqa: BLE001
                rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results/pools"))
    ap.add_argument("--budget-gb", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--contexts", default="", help="timing contexts, comma separated")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tag", default="")
    ap.add_argument("--warm", type=int, default=WARM, help="decode steps before timing")
    ap.add_argument("--codebooks", choices=("calibrated", "random"), default="calibrated")
    ap.add_argument("--engine-warmup", action="store_true",
                    help="also run Engine.warmup (prefill and writeback compiles) per cell")
    ap.add_argument("--precision", choices=("highest", "tf32", "bf16"), default="highest",
                    help="ModelConfig.matmul_precision of the slice (prefill speed)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new timing cell after this many seconds (results so far "
                         "are written after every cell)")
    args = ap.parse_args()
    start = time.perf_counter()
    s = settings(args.smoke)
    s["model"] = dataclasses.replace(s["model"], matmul_precision=args.precision)
    methods = tuple(m for m in args.methods.split(",") if m)
    if set(methods) - set(METHODS):
        ap.error(f"--methods: choose from {METHODS}")
    contexts = tuple(int(c) for c in args.contexts.split(",") if c)
    budget = 0.01 if args.smoke and args.budget_gb == 100.0 else args.budget_gb
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"pools_gpu_{args.tag}.json" if args.tag else "pools_gpu.json"

    def save(records):
        (out / name).write_text(json.dumps(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "argv": vars(args), "records": records}, indent=1))

    over = lambda: (args.budget_s is not None  # noqa: E731
                    and time.perf_counter() - start > args.budget_s)
    records = [] if args.skip_capacity else capacity(s, budget, methods)
    save(records)
    if not args.skip_timing:
        steps = 2 if args.smoke else args.steps
        records += timing(s, args.batch, steps, args.warm, methods, contexts, args.codebooks,
                          args.engine_warmup, over, lambda t: save(records + t))
        save(records)
    print(f"\ncapacity in {budget} GiB (4-layer slice; pools vs preallocated at max_len "
          f"{s['max_len']})")
    print(f"{'method':>10} {'context':>8} {'MB/req':>9} {'pool MB/req':>11} {'N pools':>8} "
          f"{'reserved':>8} {'N prealloc':>10}")
    for r in records:
        if r["part"] == "capacity":
            print(f"{r['method']:>10} {r['context']:>8} {r['per_request_bytes'] / 2**20:9.2f} "
                  f"{r['pool_bytes_per_request'] / 2**20:11.2f} {r['max_concurrency']:>8} "
                  f"{r.get('reserved', r.get('error', '-'))!s:>8} "
                  f"{r['max_concurrency_preallocated']:>10}")
    print(f"\ndecode step ms, B={args.batch} (preallocated -> pools)")
    rows = {}
    for r in records:
        if r["part"] == "timing":
            rows.setdefault((r["method"], r["context"]), {})[r["layout"]] = r
    for (method, context), by in rows.items():
        a, b = by.get("preallocated", {}), by.get("pools", {})
        fmt = lambda r: f"{r['step_ms']:.2f}" if "step_ms" in r else "err"  # noqa: E731
        ratio = (f"{b['step_ms'] / a['step_ms']:.3f}x" if "step_ms" in a and "step_ms" in b
                 else "-")
        print(f"{method:>10} {context:>8} {fmt(a):>9} -> {fmt(b):>9} {ratio:>8} "
              f"identical={b.get('tokens_identical', '-')}")


if __name__ == "__main__":
    main()
