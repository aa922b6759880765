"""Scale study: every method at V4-Flash attention shapes, by context and batch.

Gin header -- must be set: run.experiment = @scale, run.name, scale.model (e.g. the v4_flash
preset with a 4-layer slice: configs/experiments/scale.gin). Everything else has a default.
Writes runs/<name>/{config.gin, results.json, scale.png}; results.json is rewritten after every
cell and a rerun skips the cells it already holds (resume across device calls).

For each context the model is sized to it (max_len = context + decode steps, so a slot holds
exactly that context) and one random-token prompt is prefilled once (timed after a one-chunk
warm-up compile); every (method, batch) cell then admits ``batch`` copies of that prefill,
warms the decode step up (compile, timed separately) and times ``steps`` decode steps.
Random weights select nearly independently from step to step, which is the worst case for
every cache (hot cache, key cache); each record states the measured reuse.
A cell whose per-request device bytes (``memory.accounting``, exact for this implementation)
times the batch exceed ``device_budget_gb`` is recorded as skipped, not run.

Record keys: method, context, batch, layers, step_ms, prefill_s, warmup_s,
device_bytes_per_request, host_bytes_per_request, host_bytes_per_token, reuse,
resolved_fraction (tail-or-resident / hot / host), or skipped with the reason, or error (a
cell that raised; the grid goes on, and a rerun retries it); ``full_model``: the
extrapolation to the whole model (``extrapolate``) when ``full_pattern`` is given.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import gin
import jax
import numpy as np
from tqdm.auto import tqdm

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
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import prefill

PROFILED_STEPS = 3  # extra steps traced in profiled cells (not timed)


def _check(methods, contexts, batches, steps):
    for m in methods:
        if m not in method_names():
            raise ValueError(f"scale.methods: unknown method {m!r}; allowed: {method_names()}")
    for name, values in (("contexts", contexts), ("batches", batches)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"scale.{name}={values!r}: a non-empty tuple of positive ints")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"scale.steps={steps!r}: a positive int")


@gin.configurable
def scale(name: str, model=gin.REQUIRED, methods=("resident", "hisparse", "leansparse",
                                                   "adaptive"),
          contexts=(32768, 131072), batches=(1, 8), steps: int = 16, warm_steps: int = 4,
          prefill_chunk: int = 4096, hot_cache_rows: int = 4096, page_size: int = 64,
          leansparse=None, calibration_tokens: int = 4096, lent_fraction: float = 0.5,
          device_budget_gb: float = 120.0, implementation: str | None = "xla",
          profile: tuple = (), full_pattern: tuple | None = None, seed: int = 0):
    """Runs the grid; returns the records. ``lent_fraction``: adaptive's optional pages as a
    fraction of the batch's complete prompt pages. ``profile``: (method, context, batch) cells
    whose timed steps are also traced (jax.profiler; a Perfetto trace per cell is copied to
    runs/<name>/trace_<method>_<context>_<batch>.json.gz). ``full_pattern``: the whole
    model's layer pattern (e.g. V4-Flash's 43 layers) for ``extrapolate``."""
    _check(methods, contexts, batches, steps)
    lean = leansparse or LeanSparseConfig()
    out = run_dir(name)
    path = out / "results.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in records if "error" not in r]  # failed cells are retried
    done = {(r["method"], r["context"], r["batch"]) for r in records}
    for context in contexts:
        todo = [(m, b) for m in methods for b in batches if (m, context, b) not in done]
        if not todo:
            continue
        cfg = fit_max_len(model, context + steps + warm_steps + PROFILED_STEPS + 2)
        params = init_params(cfg, seed)
        prompt = np.random.default_rng(seed + context).integers(
            0, min(cfg.vocab_size, 256), context).astype(np.int32)
        jax.block_until_ready(prefill(params, cfg, prompt[:prefill_chunk], prefill_chunk,
                                      implementation=implementation))
        t0 = time.perf_counter()
        with tqdm(total=context, desc=f"prefill {context}", unit="tok") as bar:
            pre = jax.block_until_ready(prefill(params, cfg, prompt, prefill_chunk, bar,
                                                  implementation=implementation))
        prefill_s = time.perf_counter() - t0
        books, calibration_s = None, None
        if any(method_storage(m).keys_on_host for m, _ in todo):
            t0 = time.perf_counter()  # includes its compiles: what a user waits for
            books = jax.block_until_ready(calibrate_codebooks(
                params, cfg, prompt[:calibration_tokens], subspace_dim=lean.pq_subspace_dim,
                iters=8, seed=seed))
            calibration_s = time.perf_counter() - t0
        for method, batch in todo:
            trace = (out / f"trace_{method}_{context}_{batch}"
                     if (method, context, batch) in set(map(tuple, profile)) else None)
            try:
                rec = decode_cell(cfg, params, books, pre, prompt, method, batch, steps,
                                  warm_steps, prefill_chunk, hot_cache_rows, page_size, lean,
                                  lent_fraction, device_budget_gb, implementation, trace)
            except Exception as err:  # noqa: BLE001  (recorded, the grid goes on)
                rec = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            rec.update(method=method, context=context, batch=batch, layers=cfg.num_layers,
                       prefill_s=prefill_s)
            if full_pattern and "step_ms" in rec:
                rec["full_model"] = extrapolate(cfg, rec, full_pattern, hot_cache_rows,
                                                page_size, lean)
            if method_storage(method).keys_on_host:
                rec["calibration_s"] = calibration_s
            records.append(rec)
            _write(out, model, records)
            print(json.dumps({k: rec[k] for k in ("method", "context", "batch", "step_ms",
                                                  "warmup_s", "skipped", "error") if k in rec}),
                  flush=True)
        del pre
    _write(out, model, records)
    return records


def decode_cell(cfg, params, books, pre, prompt, method, batch, steps, warm_steps, chunk,
                hot_rows, page, lean, lent_fraction, budget_gb, implementation,
                trace=None) -> dict:
    """``batch`` copies of one prefill (``pre`` of ``prompt``) decoded by ``method``: the
    mean of ``steps`` decode steps after ``warm_steps``, with the selection statistics (also
    the capacity experiment's timing)."""
    storage = method_storage(method)
    pages = len(prompt) // cfg.csa_ratio // page
    cache = CacheConfig(batch, chunk, hot_rows if storage.kv_on_host else None, page,
                        optional_pages=max(1, int(batch * pages * lent_fraction))
                        if storage.lent_pages else None)
    engine = EngineConfig(model=cfg, cache=cache, sampling=SamplingConfig(0.0, 0),
                          method=method, leansparse=lean, implementation=implementation)
    per = request_bytes(engine, cfg.max_len)
    need = per.gpu_total * batch
    if need > budget_gb * 2**30:
        return {"skipped": f"needs {need / 2**30:.1f} GiB of request state > budget "
                           f"{budget_gb} GiB", "device_bytes_per_request": per.gpu_total}
    eng = Engine(engine, params, books)
    t0 = time.perf_counter()
    eng.warmup()
    warmup_s = time.perf_counter() - t0
    for _ in range(batch):
        eng.admit(Request(prompt, max_new_tokens=steps + warm_steps + PROFILED_STEPS + 1),
                  prefilled=pre)
    step_ms = timed_steps(eng, warm_steps, steps)
    if trace is not None:  # a few more steps under the profiler (not in step_ms)
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                eng.step()
            jax.block_until_ready(eng.state)
        for f in trace.rglob("*.trace.json.gz"):
            shutil.copy(f, trace.with_suffix(".json.gz"))
        shutil.rmtree(trace)
    m = eng.metrics()
    sel = m["selection"]
    return {"step_ms": step_ms, "warmup_s": warmup_s,
            "device_bytes_per_request": m["device_bytes_per_request"],
            "host_bytes_per_request": per.host_total,
            "host_bytes_per_token": m["host_bytes_per_token"],
            "reuse": sel["reuse_fraction"], "resolved_fraction": sel["resolved_fraction"]}


def extrapolate(cfg, rec: dict, pattern: tuple, hot_rows: int, page: int, lean) -> dict:
    """A slice's cell extrapolated to the whole model of layer kinds ``pattern``.

    Bytes per request: exact, ``memory.accounting.request_bytes`` of the whole pattern at the
    same settings (it is what the allocation would be). Step time: an extrapolation, not a
    measurement: the slice's step scaled by layers, step_ms * L_full / L_slice, with the
    slice's mix of layer kinds standing for the model's (V4-Flash: 21 CSA, 20 HCA, 2 SWA of 43;
    the slice: 2 CSA, 1 HCA, 1 SWA) and its fixed per-step costs (embedding, head, sampling,
    dispatch) scaled too, so an upper bound where those matter.
    """
    full = dataclasses.replace(cfg, layer_pattern=tuple(pattern))
    storage = method_storage(rec["method"])
    cache = CacheConfig(rec["batch"], 4096, hot_rows if storage.kv_on_host else None, page,
                        optional_pages=1 if storage.lent_pages else None)
    engine = EngineConfig(model=full, cache=cache, method=rec["method"], leansparse=lean)
    per = request_bytes(engine, full.max_len)
    return {"layers": full.num_layers, "device_bytes_per_request": per.gpu_total,
            "host_bytes_per_request": per.host_total,
            "step_ms_extrapolated": rec["step_ms"] * full.num_layers / cfg.num_layers,
            "note": "bytes: accounting of the whole pattern (exact); step: the slice's step "
                    "scaled by layer count (an extrapolation)"}


def _write(out, model, records):
    results = {"model": dataclasses.asdict(model), "device": jax.devices()[0].device_kind,
               "jax": jax.__version__, "records": records}
    write_results(out, results)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in records}):
        for batch in sorted({r["batch"] for r in records}):
            pts = sorted((r["context"], r["step_ms"]) for r in records
                         if r["method"] == method and r["batch"] == batch and "step_ms" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{method} B={batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=120)
    plt.close(fig)
