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

Methods are serving methods or variants of one: ``leansparse_g<G>`` is leansparse with
``LeanSparseConfig.groups = G`` (request groups; a batch G does not divide is recorded as
skipped). Cells run batch by batch (every method at the first batch of ``batches``, then the
next), so a run cut short leaves whole rows of the table. ``batches_by_context`` overrides
``batches`` per context (e.g. only (1, 8) at 1M).

Bounded calls: with ``time_budget_s`` the grid starts a context's prefill or a cell only if its
estimate (from the records so far, ``_Estimates``) fits in what is left, and otherwise stops,
listing the cells left in results.json's ``pending``; a rerun continues. ``prefill_cache``: a
directory where each context's prefill (caches and last logits) is saved after it is computed
and loaded on a later run (same model, prompt and chunk), so a later call on the same machine
skips the prefill; the records keep the measured ``prefill_s``.

Record keys: method, context, batch, layers, step_ms, prefill_s, warmup_s, admit_s, cell_s,
device_bytes_per_request, host_bytes_per_request, host_bytes_per_token, reuse,
resolved_fraction (tail-or-resident / hot / host), groups (leansparse variants), or skipped
with the reason, or error (a cell that raised; the grid goes on, and a rerun retries it);
``full_model``: the extrapolation to the whole model (``extrapolate``) when ``full_pattern``
is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import shutil
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments.common import (
    decode_step_memory,
    fit_max_len,
    pyplot,
    run_dir,
    timed_steps,
    write_results,
)
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
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import prefill

PROFILED_STEPS = 3  # extra steps traced in profiled cells (not timed)
_VARIANT = re.compile(r"leansparse(?:_g(\d+))?(_fp8)?(_jt)?(_pk)?$")


def method_variant(name: str, lean: LeanSparseConfig) -> tuple[str, LeanSparseConfig]:
    """The serving method of a grid entry and its LeanSparse settings: ``leansparse_g<G>`` is
    leansparse with G request groups, a ``_fp8`` suffix (``leansparse_fp8``,
    ``leansparse_g2_fp8``) its FP8 coarse pass (``coarse_precision="fp8"``), a last ``_jt``
    suffix (``leansparse_fp8_jt``) its coarse pass through the jax-triton kernel
    (``coarse_implementation="jax_triton"``, GPU only), a final ``_pk`` its host key rows
    packed (``host_key_rows="packed"``); any other entry is a method name, unchanged."""
    match = _VARIANT.match(name)
    if match:
        groups, fp8, jt, pk = match.groups()
        return "leansparse", dataclasses.replace(
            lean, groups=int(groups) if groups else lean.groups,
            coarse_precision="fp8" if fp8 else lean.coarse_precision,
            coarse_implementation="jax_triton" if jt else lean.coarse_implementation,
            host_key_rows="packed" if pk else lean.host_key_rows)
    return name, lean


def _check(methods, contexts, batches, steps, by_context=None):
    for m in methods:
        if method_variant(m, LeanSparseConfig())[0] not in method_names():
            raise ValueError(f"scale.methods: unknown method {m!r}; allowed: {method_names()} "
                             "or leansparse[_g<groups>][_fp8][_jt][_pk]")
    for context, values in (by_context or {}).items():
        if context not in contexts or not values \
                or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"scale.batches_by_context: {context!r}: {values!r} must map a "
                             "context of scale.contexts to a non-empty tuple of positive ints")
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
          profile: tuple = (), full_pattern: tuple | None = None, seed: int = 0,
          batches_by_context: dict | None = None, time_budget_s: float | None = None,
          prefill_cache: str | None = None, pipelined: bool = True,
          input_repeat: float | None = None, time_both_modes: bool = False,
          memory_analysis: bool = False, repeats: int = 1):
    """Runs the grid; returns the records. ``lent_fraction``: adaptive's optional pages as a
    fraction of the batch's complete prompt pages. ``profile``: (method, context, batch) cells
    whose timed steps are also traced (jax.profiler; a Perfetto trace per cell is copied to
    runs/<name>/trace_<method>_<context>_<batch>.json.gz). ``full_pattern``: the whole
    model's layer pattern (e.g. V4-Flash's 43 layers) for ``extrapolate``.
    ``batches_by_context``, ``time_budget_s``, ``prefill_cache``: the module docstring.
    ``pipelined``, ``input_repeat``: how the steps run (``common.timed_steps``);
    ``time_both_modes``: each cell also times ``steps`` steps the other way (pipelined or
    one step at a time), recorded as ``step_ms_pipelined`` / ``step_ms_stepwise``.
    ``memory_analysis``: each cell also records its decode step's compiled buffer sizes
    (``common.decode_step_memory``) as ``decode_memory``, taken after admission, before the
    timed steps. ``repeats``: each cell times ``repeats`` blocks of ``steps`` steps on the same
    engine, one after another; ``step_ms`` is their median, ``step_ms_blocks`` each block's
    mean (a within-cell spread: drift between cells and runs is not in it)."""
    _check(methods, contexts, batches, steps, batches_by_context)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"scale.repeats={repeats!r}: a positive int")
    lean = leansparse or LeanSparseConfig()
    started = time.perf_counter()
    left = lambda: (float("inf") if time_budget_s is None  # noqa: E731
                    else time_budget_s - (time.perf_counter() - started))
    out = run_dir(name)
    path = out / "results.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in records if "error" not in r]  # failed cells are retried
    done = {(r["method"], r["context"], r["batch"]) for r in records}
    grid = [(m, c, b) for c in contexts for b in (batches_by_context or {}).get(c, batches)
            for m in methods]  # batch-major within a context
    pending = lambda: [cell for cell in grid if cell not in done]  # noqa: E731
    for context in contexts:
        todo = [(m, b) for m, c, b in pending() if c == context]
        if not todo:
            continue
        cfg = fit_max_len(model, context + (repeats + time_both_modes) * steps + warm_steps
                          + PROFILED_STEPS + 2)
        prompt = np.random.default_rng(seed + context).integers(
            0, min(cfg.vocab_size, 256), context).astype(np.int32)
        cache_dir = None if prefill_cache is None else prefill_cache_dir(
            prefill_cache, cfg, seed, context, prefill_chunk)
        estimate = _Estimates(records, context)
        need = 10.0 if cache_dir is not None and cache_dir.exists() else \
            estimate.prefill_s(context)
        if need > left():
            print(f"scale: time budget: {left():.0f} s left < ~{need:.0f} s for the "
                  f"{context}-token prefill; stopped (rerun to continue)", flush=True)
            break
        params = init_params(cfg, seed)
        pre, prefill_s = cached_prefill(params, cfg, prompt, prefill_chunk, cache_dir,
                                        implementation)
        books, calibration_s = None, None
        if any(method_storage(method_variant(m, lean)[0]).keys_on_host for m, _ in todo):
            t0 = time.perf_counter()  # includes its compiles: what a user waits for
            books = jax.block_until_ready(calibrate_codebooks(
                params, cfg, prompt[:calibration_tokens], subspace_dim=lean.pq_subspace_dim,
                iters=8, seed=seed))
            calibration_s = time.perf_counter() - t0
        stopped = False
        for entry, batch in todo:
            need = estimate.cell_s(entry, batch, repeats * steps + warm_steps)
            if need > left():
                print(f"scale: time budget: {left():.0f} s left < ~{need:.0f} s for "
                      f"{entry} at batch {batch}; stopped (rerun to continue)", flush=True)
                stopped = True
                break
            method, settings = method_variant(entry, lean)
            trace = (out / f"trace_{entry}_{context}_{batch}"
                     if (entry, context, batch) in set(map(tuple, profile)) else None)
            t0 = time.perf_counter()
            if batch % settings.groups:
                rec = {"skipped": f"{settings.groups} request groups need a batch divisible "
                                  f"by {settings.groups}"}
            else:
                try:
                    rec = decode_cell(cfg, params, books, pre, prompt, method, batch, steps,
                                      warm_steps, prefill_chunk, hot_cache_rows, page_size,
                                      settings, lent_fraction, device_budget_gb,
                                      implementation, trace, pipelined=pipelined,
                                      input_repeat=input_repeat, both=time_both_modes,
                                      memory=memory_analysis, repeats=repeats)
                except Exception as err:  # noqa: BLE001  (recorded, the grid goes on)
                    rec = {"error": f"{type(err).__name__}: "
                                    f"{str(err).splitlines()[0][:300]}"}
            rec.update(method=entry, context=context, batch=batch, layers=cfg.num_layers,
                       prefill_s=prefill_s, cell_s=time.perf_counter() - t0,
                       pipelined=pipelined, input_repeat=input_repeat)
            if settings.groups > 1:
                rec["groups"] = settings.groups
            if full_pattern and "step_ms" in rec:
                rec["full_model"] = extrapolate(cfg, rec, full_pattern, hot_cache_rows,
                                                page_size, settings)
            if method_storage(method).keys_on_host:
                rec["calibration_s"] = calibration_s
            records.append(rec)
            done.add((entry, context, batch))
            estimate = _Estimates(records, context)
            _write(out, model, records, pending())
            print(json.dumps({k: rec[k] for k in ("method", "context", "batch", "step_ms",
                                                  "warmup_s", "cell_s", "skipped", "error")
                              if k in rec}), flush=True)
        del pre
        if stopped:
            break
    _write(out, model, records, pending())
    return records


def prefill_cache_dir(root: str, cfg, seed: int, context: int, chunk: int) -> pathlib.Path:
    """The prefill cache folder of one (model, prompt, chunk): a hash of what decides it."""
    key = hashlib.sha1(repr((cfg, seed, context, chunk)).encode()).hexdigest()[:16]
    return pathlib.Path(root) / f"prefill_{context}_{key}"


def cached_prefill(params, cfg, prompt, chunk: int, cache_dir: pathlib.Path | None,
                   implementation: str | None = "xla"):
    """(caches and last logits of ``prompt``, prefill seconds): computed (timed after a
    one-chunk warm-up compile; top-k by ``implementation``) and saved to ``cache_dir``, or
    loaded from it with the seconds it took when it was computed."""
    shape = jax.eval_shape(lambda: (empty_cache(cfg), jnp.zeros((cfg.vocab_size,))))
    leaves, tree = jax.tree.flatten(shape)
    if cache_dir is not None and (cache_dir / "meta.json").exists():
        meta = json.loads((cache_dir / "meta.json").read_text())
        arrays = [np.fromfile(cache_dir / f"{i}.bin", np.uint8).view(leaf.dtype)
                  .reshape(leaf.shape) for i, leaf in enumerate(leaves)]
        print(f"scale: prefill of {len(prompt)} tokens loaded from {cache_dir}", flush=True)
        return jax.device_put(jax.tree.unflatten(tree, arrays)), meta["prefill_s"]
    jax.block_until_ready(prefill(params, cfg, prompt[:chunk], chunk,
                                  implementation=implementation))
    t0 = time.perf_counter()
    with tqdm(total=len(prompt), desc=f"prefill {len(prompt)}", unit="tok") as bar:
        pre = jax.block_until_ready(prefill(params, cfg, prompt, chunk, bar,
                                            implementation=implementation))
    prefill_s = time.perf_counter() - t0
    if cache_dir is not None:
        got = jax.tree.leaves(pre)
        if [(a.shape, a.dtype) for a in got] != [(a.shape, a.dtype) for a in leaves]:
            raise ValueError("scale: the prefill's result does not have the cache layout "
                             "of empty_cache (cannot cache it)")
        tmp = cache_dir.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, a in enumerate(got):
            np.asarray(a).view(np.uint8).tofile(tmp / f"{i}.bin")
        (tmp / "meta.json").write_text(json.dumps({"prefill_s": prefill_s,
                                                   "tokens": len(prompt)}))
        tmp.rename(cache_dir)
    return pre, prefill_s


class _Estimates:
    """Seconds a context's prefill or a cell will take, from the records so far (used to stop
    before a time budget runs out; rough by design, on the safe side).

    Prefill: the recorded prefill_s of this context, else the largest smaller recorded
    context's scaled by (context ratio)^2, else 0 (unknown: it runs). Cell: a fixed part, the
    largest recorded cell time less its admissions at this context (engine, warm-up compile,
    steps; else 20 s; the method's own cells where it has some: a 100 s LeanSparse cell at
    batch 64 says little of resident at batch 1), plus per request the largest recorded
    admission seconds (else 0.5 s),
    ``steps`` decode steps at the largest recorded step ms per request (else 2 ms) and its
    host pools filled at 2 GB/s (pinned_host allocation grows with the batch), times 1.25.
    """

    def __init__(self, records, context: int):
        self.records = [r for r in records if "step_ms" in r]
        here = [r for r in self.records if r["context"] == context]
        fixed = lambda rs, default: max(  # noqa: E731
            [r.get("cell_s", r["warmup_s"]) - r.get("admit_s", 0.0) for r in rs],
            default=default)
        self.fixed = fixed(here, 20.0)
        self.fixed_by = {m: fixed([r for r in here if r["method"] == m], 0.0)
                         for m in {r["method"] for r in here}}
        self.admit = max([r.get("admit_s", 0.0) / r["batch"] for r in here], default=0.5)
        self.step = max([r["step_ms"] / 1e3 / r["batch"] for r in here], default=2e-3)
        self.host = {r["method"]: r["host_bytes_per_request"] / 2e9 for r in here}

    def prefill_s(self, context: int) -> float:
        known = {r["context"]: r["prefill_s"] for r in self.records}
        if context in known:
            return known[context]
        smaller = [c for c in known if c < context]
        return known[max(smaller)] * (context / max(smaller)) ** 2 if smaller else 0.0

    def cell_s(self, method: str, batch: int, steps: int) -> float:
        host = self.host.get(method, max(self.host.values(), default=0.0))
        fixed = self.fixed_by.get(method, self.fixed)
        return 1.25 * (fixed + batch * (self.admit + steps * self.step + host))


def decode_cell(cfg, params, books, pre, prompt, method, batch, steps, warm_steps, chunk,
                hot_rows, page, lean, lent_fraction, budget_gb, implementation,
                trace=None, *, pipelined: bool = True,
                input_repeat: float | None = None, both: bool = False,
                memory: bool = False, repeats: int = 1) -> dict:
    """``batch`` copies of one prefill (``pre`` of ``prompt``) decoded by ``method``: the
    mean of ``steps`` decode steps after ``warm_steps`` (``common.timed_steps``; with
    ``repeats`` > 1 the median of that many such blocks), with the selection statistics (also
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
    t0 = time.perf_counter()
    for _ in range(batch):
        eng.admit(Request(prompt, max_new_tokens=(repeats + both) * steps + warm_steps
                          + PROFILED_STEPS + 1), prefilled=pre)
    admit_s = time.perf_counter() - t0
    extra = {"decode_memory": decode_step_memory(eng)} if memory else {}
    # block 0 as before (warm-up, input seed 0); later blocks draw their inputs from seeds 3+
    blocks = [timed_steps(eng, 0 if i else warm_steps, steps, pipelined, input_repeat,
                          seed=2 + i if i else 0) for i in range(repeats)]
    step_ms = float(np.median(blocks))
    if repeats > 1:
        extra["step_ms_blocks"] = blocks
    modes = {}
    if both:  # the same engine, the other way (its first steps compile nothing new)
        other = timed_steps(eng, 0, steps, not pipelined, input_repeat, seed=2)
        piped, stepwise = (step_ms, other) if pipelined else (other, step_ms)
        modes = {"step_ms_pipelined": piped, "step_ms_stepwise": stepwise}
    if trace is not None:  # a few more steps under the profiler (not in step_ms)
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            timed_steps(eng, 0, PROFILED_STEPS, pipelined, input_repeat, seed=1)
        for f in trace.rglob("*.trace.json.gz"):
            shutil.copy(f, trace.with_suffix(".json.gz"))
        shutil.rmtree(trace)
    m = eng.metrics()
    sel = m["selection"]
    return {"step_ms": step_ms, **modes, **extra, "warmup_s": warmup_s, "admit_s": admit_s,
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
    method, lean = method_variant(rec["method"], lean)
    storage = method_storage(method)
    cache = CacheConfig(rec["batch"], 4096, hot_rows if storage.kv_on_host else None, page,
                        optional_pages=1 if storage.lent_pages else None)
    engine = EngineConfig(model=full, cache=cache, method=method, leansparse=lean)
    per = request_bytes(engine, full.max_len)
    return {"layers": full.num_layers, "device_bytes_per_request": per.gpu_total,
            "host_bytes_per_request": per.host_total,
            "step_ms_extrapolated": rec["step_ms"] * full.num_layers / cfg.num_layers,
            "note": "bytes: accounting of the whole pattern (exact); step: the slice's step "
                    "scaled by layer count (an extrapolation)"}


def _write(out, model, records, pending=()):
    results = {"model": dataclasses.asdict(model), "device": jax.devices()[0].device_kind,
               "jax": jax.__version__, "records": records,
               "pending": [list(cell) for cell in pending]}
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
