"""Tensor parallelism study: decode step time and capacity, 1 vs several devices, per method.

Gin header -- must be set: run.experiment = @tp, run.name, tp.model (e.g. the v4_flash preset
with a 4-layer slice: configs/experiments/tp.gin). Everything else has a default.
Writes runs/<name>/{config.gin, results.json, tp.png}; results.json is rewritten after every
cell and a rerun skips the cells it already holds.

For each context the model is sized to it and one random-token prompt is prefilled once on
one device; every (method, batch, devices) cell admits ``batch`` copies of that prefill (copied
to every device of the mesh when devices > 1), warms the decode step up and times ``steps``
decode steps (``EngineConfig.tp = devices``; ``lsparse_jax.parallel``).

Capacity: ``max_concurrency`` is the number of requests of this context whose device state fits
one device's ``device_budget_gb`` beside that device's share of the parameters:
floor((budget - parameter bytes per device) / device bytes per request), the request bytes from
``memory.accounting`` (exact for the allocated arrays). Under tensor parallelism every device
holds a full copy of each request's state (the state has no head axis), so only the split
parameters free room. A cell whose batch exceeds max_concurrency is recorded as skipped.

Record keys: method, devices, context, batch, step_ms, max_concurrency,
param_bytes_per_device, device_bytes_per_request, warmup_s, admit_s, prefill_s, prefill
("model", or "random": ``random_caches``); or skipped / error.
results.json also holds ``scaling``: per (method, context, batch) with both 1 and N devices,
step_ratio = step_ms(N) / step_ms(1) and capacity_ratio = max_concurrency(N) / (1).
"""

from __future__ import annotations

import dataclasses
import json
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from experiments.common import fit_max_len, pyplot, run_dir, timed_steps, write_results
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_names,
    method_storage,
)
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.parallel import param_spec, replicate
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import prefill

GiB = 2**30


def _check(methods, devices, contexts, batches, steps):
    for m in methods:
        if m not in method_names():
            raise ValueError(f"tp.methods: unknown method {m!r}; allowed: {method_names()}")
    for name, values in (("devices", devices), ("contexts", contexts), ("batches", batches)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"tp.{name}={values!r}: a non-empty tuple of positive ints")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"tp.steps={steps!r}: a positive int")


def param_bytes_per_device(params, tp: int) -> int:
    """Bytes of the parameters one device holds when ``tp`` devices split them
    (``param_spec``: split arrays hold 1/tp each, the rest a full copy)."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = tuple(getattr(k, "key", str(k)) for k in path)
        split = param_spec(keys) != PartitionSpec()
        total += leaf.nbytes // tp if split else leaf.nbytes
    return total


@gin.configurable
def tp(name: str, model=gin.REQUIRED, methods=("resident", "hisparse", "leansparse", "adaptive"),
       devices=(1, 2), contexts=(524288,), batches=(64,), steps: int = 8, warm_steps: int = 2,
       prefill_chunk: int = 4096, hot_cache_rows: int = 4096, page_size: int = 64,
       leansparse=None, calibration_tokens: int = 4096, lent_fraction: float = 0.5,
       device_budget_gb: float = 100.0, implementation: str | None = "xla",
       time_limit_s: float | None = None, random_caches: bool = False, seed: int = 0):
    """Runs the grid (cells in the order context, method, batch, devices); returns the
    records. ``time_limit_s``: no new cell starts after this many seconds (the rest are
    left for a rerun, which resumes). ``random_caches``: admit random caches of the context's
    shapes instead of prefilling the prompt (``random_prefill``: the 512K prefill takes ~70 s
    on an H200; decode time does not depend on the cached values, which with random weights
    select nearly at random either way); records then say prefill "random"."""
    _check(methods, devices, contexts, batches, steps)
    start = time.perf_counter()
    lean = leansparse or LeanSparseConfig()
    out = run_dir(name)
    path = out / "results.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in records if "error" not in r]  # failed cells are retried
    done = {(r["method"], r["devices"], r["context"], r["batch"]) for r in records}
    for context in contexts:
        todo = [(m, b, n) for m in methods for b in batches for n in devices
                if (m, n, context, b) not in done]
        if not todo:
            continue
        cfg = fit_max_len(model, context + steps + warm_steps + 2)
        params = init_params(cfg, seed)
        prompt = np.random.default_rng(seed + context).integers(
            0, min(cfg.vocab_size, 256), context).astype(np.int32)
        t0 = time.perf_counter()
        if random_caches:
            pre = jax.block_until_ready(random_prefill(cfg, seed))
        else:
            pre = jax.block_until_ready(prefill(params, cfg, prompt, prefill_chunk))
        prefill_s = time.perf_counter() - t0  # includes the chunk's compile
        books = None
        if any(method_storage(m).keys_on_host for m, _, _ in todo):
            books = calibrate_codebooks(params, cfg, prompt[:calibration_tokens],
                                        subspace_dim=lean.pq_subspace_dim, iters=8, seed=seed)
        for method, batch, n in todo:
            if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
                print(json.dumps({"time_limit_s": time_limit_s, "left": "rerun resumes"}))
                _write(out, model, records)
                return records
            try:
                rec = _cell(cfg, params, books, pre, prompt, method, batch, n, steps,
                            warm_steps, prefill_chunk, hot_cache_rows, page_size, lean,
                            lent_fraction, device_budget_gb, implementation)
            except Exception as err:  # noqa: BLE001  (recorded, the grid goes on)
                rec = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            rec.update(method=method, devices=n, context=context, batch=batch,
                       layers=cfg.num_layers, prefill_s=prefill_s,
                       prefill="random" if random_caches else "model")
            records.append(rec)
            _write(out, model, records)
            print(json.dumps({k: rec[k] for k in ("method", "devices", "context", "batch",
                                                  "step_ms", "max_concurrency", "skipped",
                                                  "error") if k in rec}), flush=True)
        del pre
    _write(out, model, records)
    return records


def random_prefill(cfg, seed: int):
    """What ``steps.prefill`` returns for a prompt of ``cfg.max_len`` tokens, with random
    values: (caches, last logits [V]); every cache leaf standard normal in its dtype."""
    leaves, tree = jax.tree.flatten(empty_cache(cfg))
    keys = jax.random.split(jax.random.key(seed), len(leaves) + 1)

    @jax.jit
    def fill(keys):
        vals = [jnp.abs(jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)  # e8m0
                if a.dtype == jnp.float8_e8m0fnu else  # scales have no sign
                jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)
                for k, a in zip(keys[1:], leaves)]
        return jax.tree.unflatten(tree, vals), jax.random.normal(keys[0], (cfg.vocab_size,))

    return fill(keys)


def _cell(cfg, params, books, pre, prompt, method, batch, n, steps, warm_steps, chunk,
          hot_rows, page, lean, lent_fraction, budget_gb, implementation) -> dict:
    storage = method_storage(method)
    pages = len(prompt) // cfg.csa_ratio // page
    cache = CacheConfig(batch, chunk, hot_rows if storage.kv_on_host else None, page,
                        optional_pages=max(1, int(batch * pages * lent_fraction))
                        if storage.lent_pages else None)
    engine = EngineConfig(model=cfg, cache=cache, sampling=SamplingConfig(0.0, 0),
                          method=method, leansparse=lean, implementation=implementation, tp=n)
    per_request = request_bytes(engine, cfg.max_len).gpu_total  # each device's copy
    weights = param_bytes_per_device(params, n)
    capacity = max(0, int((budget_gb * GiB - weights) // per_request))
    rec = {"max_concurrency": capacity, "param_bytes_per_device": weights,
           "device_bytes_per_request": per_request}
    if batch > capacity:
        return {**rec, "skipped": f"batch {batch} > max_concurrency {capacity} at "
                                  f"{budget_gb} GiB per device"}
    eng = Engine(engine, params, books)
    prefilled = pre if eng.mesh is None else replicate(pre, eng.mesh)
    t0 = time.perf_counter()
    eng.warmup()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(batch):
        eng.admit(Request(prompt, max_new_tokens=steps + warm_steps + 1), prefilled=prefilled)
    admit_s = time.perf_counter() - t0
    return {**rec, "step_ms": timed_steps(eng, warm_steps, steps), "warmup_s": warmup_s,
            "admit_s": admit_s}


def scaling(records) -> list[dict]:
    """step_ms and max_concurrency of N devices relative to 1 device, per (method, context,
    batch) where both ran."""
    by = {(r["method"], r["context"], r["batch"], r["devices"]): r for r in records
          if "step_ms" in r}
    rows = []
    for (method, context, batch, n), r in sorted(by.items()):
        base = by.get((method, context, batch, 1))
        if n == 1 or base is None:
            continue
        rows.append({"method": method, "context": context, "batch": batch, "devices": n,
                     "step_ratio": r["step_ms"] / base["step_ms"],
                     "capacity_ratio": r["max_concurrency"] / max(base["max_concurrency"], 1)})
    return rows


def _write(out, model, records):
    results = {"model": dataclasses.asdict(model), "device": jax.devices()[0].device_kind,
               "device_count": jax.device_count(), "jax": jax.__version__,
               "records": records, "scaling": scaling(records)}
    write_results(out, results)
    plt = pyplot()
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(9, 3.6))
    cells = sorted({(r["method"], r["context"], r["batch"]) for r in records})
    counts = sorted({r["devices"] for r in records})
    width = 0.8 / max(len(counts), 1)
    for j, n in enumerate(counts):
        by = {(r["method"], r["context"], r["batch"]): r for r in records if r["devices"] == n}
        xs = np.arange(len(cells)) + j * width
        ax_t.bar(xs, [by.get(c, {}).get("step_ms", 0.0) for c in cells], width, label=f"{n} dev")
        ax_c.bar(xs, [by.get(c, {}).get("max_concurrency", 0) for c in cells], width,
                 label=f"{n} dev")
    labels = [f"{m}\n{f'{c // 1024}K' if c >= 1024 else c} B={b}" for m, c, b in cells]
    for ax, title in ((ax_t, "decode step (ms)"), (ax_c, "max concurrency per device budget")):
        ax.set_xticks(np.arange(len(cells)) + width * (len(counts) - 1) / 2, labels, fontsize=6)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tp.png", dpi=120)
    plt.close(fig)
