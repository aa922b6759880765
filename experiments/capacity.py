"""Capacity: maximum concurrency and steady decode throughput per method under one HBM budget
(LeanSparse section 6.3, Figures 11-12).

Gin header -- must be set: run.experiment = @capacity, run.name, capacity.model (the model
that is timed, e.g. the v4_flash preset's 4-layer slice), capacity.predict_model (the model
whose byte accounting gives the concurrency: a ModelConfig or a preset name, e.g. 'v4_flash',
the full 43-layer preset).
Run: lsparse run configs/experiments/capacity_smoke.gin (CPU) or capacity.gin (GPU).
Writes runs/<name>/{config.gin, results.json, capacity.png}; results.json is rewritten after
every timed cell and a rerun skips the cells it already holds.

1. Concurrency (exact accounting, no device needed): each method's GPU bytes per request at
   each context with device pools (``memory.accounting.request_bytes``: per-slot state plus
   ceil(N_c / P) pages of every device pool, in ``layout``: 'v4_serving' = 584 B KV rows,
   132 B FP8 keys, the papers' layout), on ``predict_model``. The budget is calibrated once:
   the smallest budget plus half a request that holds ``calibrate[2]`` requests of method
   ``calibrate[0]`` at context ``calibrate[1]`` (HiSparse's N = 76 at 200K in the paper);
   every other N is a prediction: floor(budget / bytes per request) (``budget_capacity``,
   the count device pools carved from that budget admit: tests/test_device_pool.py).
2. Throughput: ``model`` is prefilled once per context (random weights, random-token prompt)
   and each method decodes min(N, max_timed_batch) copies of it (``scale.decode_cell``): the
   mean of ``steps`` steps after ``warm_steps``, or with ``repeats`` > 1 the median of that
   many such blocks (each block's in ``step_ms_blocks``); throughput = batch / step time.
   With ``equal_concurrency`` each other method is also timed at the calibrated method's N
   (Figure 12); its equal-N record carries the ratio to the calibrated method's step
   (``vs_calibrated``) and, with blocks, the widest range they allow
   (``vs_calibrated_range``: min mine / max theirs, max mine / min theirs). Random weights
   select nearly independently step to step (every cache's worst case): each record carries
   the measured step-to-step reuse.

Record keys: method, context, max_concurrency, bytes_per_request, timed_batch, step_ms,
throughput_tok_s, reuse, resolved_fraction, paper (the paper's N / tok/s / step ms where it
gives them), or error; ``equal_n`` records: method, context, batch, step_ms, vs_calibrated
(and step_ms_blocks, vs_calibrated_range with repeats > 1); ``step_fit``:
``step_fit`` of every method timed at two batch sizes.
"""

from __future__ import annotations

import dataclasses
import json
import time

import gin
import jax
import numpy as np
from tqdm.auto import tqdm

from experiments.common import block_ratio_range, fit_max_len, pyplot, run_dir, write_results
from experiments.scale import decode_cell
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    method_storage,
)
from lsparse_jax.memory.accounting import Layout, budget_capacity, request_bytes
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params, preset
from lsparse_jax.serving.steps import prefill

# LeanSparse paper, V4-Flash on 4 x H100 (TP4): (N, decode tok/s) at each context, and decode
# step ms at HiSparse's N (Figures 11-12).
PAPER = {("hisparse", 204800): (76, 2371, 32.1), ("leansparse", 204800): (156, 3216, 33.3),
         ("hisparse", 524288): (36, 1274, 28.3), ("leansparse", 524288): (96, 2022, 26.4),
         ("hisparse", 972800): (19, 687, 27.6), ("leansparse", 972800): (56, 1474, 22.2)}


# KV buffer rows per CSA layer in the LeanSparse paper's evaluation (section 6.1): HiSparse a 4K
# buffer, LeanSparse 2K KV entries (beside 4K indexer keys); adaptive as HiSparse
PAPER_HOT_ROWS = {"hisparse": 4096, "leansparse": 2048, "adaptive": 4096}


def engine_for(model, method: str, hot_cache_rows: dict, page_size: int,
               lean: LeanSparseConfig, implementation=None) -> EngineConfig:
    """The method's engine with device pools (the accounting counts whole pages)."""
    if method not in hot_cache_rows and method_storage(method).kv_on_host:
        raise ValueError(f"capacity.hot_cache_rows has no entry for {method!r}")
    rows = hot_cache_rows.get(method) if method_storage(method).kv_on_host else None
    return EngineConfig(model=model, method=method, leansparse=lean,
                        implementation=implementation,
                        cache=CacheConfig(hot_cache_rows=rows, page_size=page_size,
                                          device_pages=1,
                                          optional_pages=1 if method_storage(method).lent_pages
                                          else None))


def predict(predict_model, methods, contexts, calibrate, hot_cache_rows, page_size, lean,
            layout: Layout) -> tuple[dict, dict]:
    """(the calibrated budget's facts, {(method, context): (N, bytes per request)})."""
    cal_method, cal_context, cal_n = calibrate
    cal = engine_for(predict_model, cal_method, hot_cache_rows, page_size, lean)
    per = request_bytes(cal, cal_context, layout).gpu_total
    budget = cal_n * per + per // 2
    facts = {"budget_bytes": budget, "budget_gib": budget / 2**30,
             "per_layer_budget_mib": budget / predict_model.num_layers / 2**20,
             "layers": predict_model.num_layers, "calibrated_on": list(calibrate)}
    out = {}
    for m in methods:
        eng = engine_for(predict_model, m, hot_cache_rows, page_size, lean)
        for c in contexts:
            out[(m, c)] = (budget_capacity(eng, c, budget, layout),
                           request_bytes(eng, c, layout).gpu_total)
    return facts, out


@gin.configurable
def capacity(name: str, model=gin.REQUIRED, predict_model=gin.REQUIRED,
             methods=("hisparse", "leansparse"), contexts=(204800, 524288, 972800),
             calibrate=("hisparse", 204800, 76), layout: str = "v4_serving",
             hot_cache_rows=None, page_size: int = 64, leansparse=None,
             max_timed_batch: int = 256, equal_concurrency: bool = True, steps: int = 16,
             warm_steps: int = 4, prefill_chunk: int = 4096, calibration_tokens: int = 4096,
             device_budget_gb: float = 120.0, implementation: str | None = "xla",
             time_steps: bool = True, time_contexts=None, seed: int = 0,
             pipelined: bool = True, input_repeat: float | None = None, repeats: int = 1):
    """Predicts N per (method, context) from one calibrated budget, then times decode at
    min(N, max_timed_batch); returns the records. hot_cache_rows: {method: B} (the paper:
    HiSparse 4096, LeanSparse 2048). time_contexts: the contexts timed in this call (None:
    all; one per device call keeps each under its time limit). pipelined, input_repeat:
    how the timed steps run (``common.timed_steps``); repeats: timed blocks a cell."""
    lean = leansparse or LeanSparseConfig()
    if isinstance(predict_model, str):
        predict_model = preset(predict_model)
    hot = dict(hot_cache_rows or PAPER_HOT_ROWS)
    if layout not in ("v4_serving", "ours"):
        raise ValueError(f"capacity.layout={layout!r}: 'v4_serving' or 'ours'")
    lay = Layout.v4_serving() if layout == "v4_serving" else Layout.ours(predict_model)
    if calibrate[0] not in methods:
        raise ValueError(f"capacity.calibrate method {calibrate[0]!r} is not in "
                         f"capacity.methods={methods!r}")
    facts, pred = predict(predict_model, methods, contexts, calibrate, hot, page_size, lean,
                          lay)
    out = run_dir(name)
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    timed = {(r["method"], r["context"]): r for r in old.get("records", [])
             if "step_ms" in r}
    equal = {(r["method"], r["context"]): r for r in old.get("equal_n", [])}
    records = []
    for (m, c), (n, per) in pred.items():
        rec = {"method": m, "context": c, "max_concurrency": n, "bytes_per_request": per,
               "paper": dict(zip(("max_concurrency", "throughput_tok_s", "step_ms_at_his_n"),
                                 PAPER[(m, c)])) if (m, c) in PAPER else None}
        records.append(rec | {k: v for k, v in timed.get((m, c), {}).items()
                              if k not in rec})
    save = lambda: _write(out, facts, records, list(equal.values()),  # noqa: E731
                          dict(model=dataclasses.asdict(model), layout=layout))
    save()
    print(json.dumps(facts), flush=True)
    if time_steps:
        for c in contexts if time_contexts is None else time_contexts:
            if c not in contexts:
                raise ValueError(f"capacity.time_contexts: {c} is not in capacity.contexts")
            todo = [r for r in records if r["context"] == c and "step_ms" not in r
                    and r["max_concurrency"] > 0]
            cal_n = pred.get((calibrate[0], c), (0,))[0]
            todo_eq = [m for m in methods if m != calibrate[0] and equal_concurrency
                       and cal_n > 0 and (m, c) not in equal]
            if not todo and not todo_eq:
                continue
            cfg, params, prompt, pre, books = _prefill(model, c, steps + warm_steps + 8,
                                                       prefill_chunk, lean, methods,
                                                       calibration_tokens, seed)
            cells = [(r["method"], min(r["max_concurrency"], max_timed_batch), r)
                     for r in todo]
            same = {(m, b) for m, b, _ in cells}  # an equal-N cell already timed: reused
            cells += [(m, min(cal_n, max_timed_batch), None) for m in todo_eq
                      if (m, min(cal_n, max_timed_batch)) not in same]
            # smallest batches first: the calibrated method's N and the other methods at that
            # N (the paper's "step time at HiSparse's N") before the larger own-N cells, so a
            # call cut by its time limit keeps the comparison
            cells.sort(key=lambda cell: cell[1])
            for m, batch, rec in cells:
                try:
                    got = decode_cell(cfg, params, books, pre, prompt, m, batch, steps,
                                      warm_steps, prefill_chunk, hot.get(m, 0), page_size,
                                      lean, 0.5, device_budget_gb, implementation,
                                      pipelined=pipelined, input_repeat=input_repeat,
                                      repeats=repeats)
                except Exception as err:  # noqa: BLE001  (recorded; the grid goes on)
                    got = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
                if rec is not None:
                    rec.update(timed_batch=batch, pipelined=pipelined,
                               input_repeat=input_repeat, **{k: got[k] for k in (
                        "step_ms", "step_ms_blocks", "reuse", "resolved_fraction", "error",
                        "skipped") if k in got})
                    if "step_ms" in got:
                        rec["throughput_tok_s"] = batch / got["step_ms"] * 1e3
                elif "step_ms" in got:
                    equal[(m, c)] = _equal_record(m, c, batch, got)
                save()
                print(json.dumps({"method": m, "context": c, "batch": batch,
                                  **{k: got.get(k) for k in ("step_ms", "reuse", "error")}}),
                      flush=True)
            for m in todo_eq:  # equal-N cells that were the method's own timed cell
                rec = next(r for r in records if r["method"] == m and r["context"] == c)
                if (m, c) not in equal and rec.get("timed_batch") == min(cal_n,
                                                                         max_timed_batch):
                    equal[(m, c)] = _equal_record(m, c, rec["timed_batch"], rec)
            cal = next((r for r in records if r["method"] == calibrate[0]
                        and r["context"] == c and "step_ms" in r), None)
            for (_, ctx), e in equal.items():
                if ctx == c and cal is not None and e["batch"] == cal["timed_batch"]:
                    e.update(_vs(e, cal))
            save()
            del pre
    _table(facts, records, list(equal.values()))
    return records


def _equal_record(method, context, batch, got) -> dict:
    """An equal-N record from a timed cell's result (``decode_cell``'s or a record's)."""
    return {"method": method, "context": context, "batch": batch, "step_ms": got["step_ms"],
            "reuse": got["reuse"], **({"step_ms_blocks": got["step_ms_blocks"]}
                                      if "step_ms_blocks" in got else {})}


def _vs(mine: dict, theirs: dict) -> dict:
    """mine's step over theirs (same context and batch), and the range their blocks allow."""
    out = {"vs_calibrated": mine["step_ms"] / theirs["step_ms"]}
    if "step_ms_blocks" in mine and "step_ms_blocks" in theirs:
        out["vs_calibrated_range"] = list(block_ratio_range(mine["step_ms_blocks"],
                                                            theirs["step_ms_blocks"]))
    return out


def step_fit(records, equal) -> list[dict]:
    """Step time as a part that does not grow with the batch plus a cost per request, per
    (method, context) timed at two batch sizes (its own N and the calibrated method's N), and
    the same from the paper's two points (its step at HiSparse's N; N / its tok/s at its N).

    Notation: step(n) = a + b n through the points (n1, s1), (n2, s2): b = (s2 - s1) / (n2 - n1),
    a = s1 - b n1 (ms). A large a is what more concurrent requests amortise (the papers'
    43-layer step: weights, MoE, collectives); a 4-layer attention slice has little of it."""
    eq = {(e["method"], e["context"]): e for e in equal}
    out = []
    for r in records:
        e = eq.get((r["method"], r["context"]))
        if "step_ms" not in r or e is None or e["batch"] == r.get("timed_batch"):
            continue
        (n1, s1), (n2, s2) = sorted([(e["batch"], e["step_ms"]),
                                     (r["timed_batch"], r["step_ms"])])
        b = (s2 - s1) / (n2 - n1)
        fit = {"method": r["method"], "context": r["context"], "batches": [n1, n2],
               "fixed_ms": s1 - b * n1, "per_request_ms": b}
        paper, his = r.get("paper"), PAPER.get(("hisparse", r["context"]))
        if paper and his and paper["max_concurrency"] != his[0]:
            p1, p2 = (his[0], paper["step_ms_at_his_n"]), (
                paper["max_concurrency"], paper["max_concurrency"] / paper["throughput_tok_s"]
                * 1e3)
            pb = (p2[1] - p1[1]) / (p2[0] - p1[0])
            fit |= {"paper_fixed_ms": p1[1] - pb * p1[0], "paper_per_request_ms": pb}
        out.append(fit)
    return out


def _prefill(model, context, extra, chunk, lean, methods, calibration_tokens, seed):
    """The model sized to context + extra, its params, a random-token prompt of ``context``
    tokens prefilled once (after a one-chunk compile), and PQ codebooks if a method needs
    them."""
    cfg = fit_max_len(model, context + extra)
    params = init_params(cfg, seed)
    prompt = np.random.default_rng(seed + context).integers(
        0, min(cfg.vocab_size, 256), context).astype(np.int32)
    jax.block_until_ready(prefill(params, cfg, prompt[:chunk], chunk))
    with tqdm(total=context, desc=f"prefill {context}", unit="tok") as bar:
        pre = jax.block_until_ready(prefill(params, cfg, prompt, chunk, bar))
    books = None
    if any(method_storage(m).keys_on_host for m in methods):
        books = jax.block_until_ready(calibrate_codebooks(
            params, cfg, prompt[:calibration_tokens], subspace_dim=lean.pq_subspace_dim,
            iters=8, seed=seed))
    return cfg, params, prompt, pre, books


def _write(out, facts, records, equal, config):
    write_results(out, {"budget": facts, "records": records, "equal_n": equal,
                        "step_fit": step_fit(records, equal),
                        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **config})
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    methods = sorted({r["method"] for r in records})
    contexts = sorted({r["context"] for r in records})
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = np.arange(len(contexts)) + i * width
        ns = [next(r["max_concurrency"] for r in records
                   if r["method"] == m and r["context"] == c) for c in contexts]
        ax1.bar(xs, ns, width, label=m)
        tput = [next((r.get("throughput_tok_s", 0.0) for r in records
                      if r["method"] == m and r["context"] == c), 0.0) for c in contexts]
        ax2.bar(xs, tput, width, label=m)
    for ax, label in ((ax1, "max concurrency N"), (ax2, "decode tok/s (timed batch)")):
        ax.set_xticks(np.arange(len(contexts)) + width * (len(methods) - 1) / 2)
        ax.set_xticklabels([f"{c // 1024}K" for c in contexts])
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"budget {facts['budget_gib']:.2f} GiB "
                 f"({facts['per_layer_budget_mib']:.1f} MiB per layer)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)


def _table(facts, records, equal):
    print(f"budget {facts['budget_gib']:.3f} GiB = {facts['per_layer_budget_mib']:.1f} MiB "
          f"per layer x {facts['layers']} layers (calibrated: {facts['calibrated_on']})")
    print(f"{'method':<11} {'context':>8} {'N':>5} {'paper N':>7} {'batch':>5} "
          f"{'step ms':>8} {'tok/s':>8} {'reuse':>6}")
    for r in records:
        paper = (r["paper"] or {}).get("max_concurrency", "-")
        fmt = lambda k, f, r=r: f"{r[k]:{f}}" if r.get(k) is not None else "-"  # noqa: E731
        print(f"{r['method']:<11} {r['context']:>8} {r['max_concurrency']:>5} {paper:>7} "
              f"{fmt('timed_batch', 'd'):>5} {fmt('step_ms', '.2f'):>8} "
              f"{fmt('throughput_tok_s', '.0f'):>8} {fmt('reuse', '.3f'):>6}"
              + (f"  {r['error']}" if "error" in r else ""))
    for e in equal:
        vs = (f" = {e['vs_calibrated']:.3f} x {facts['calibrated_on'][0]}"
              if "vs_calibrated" in e else "")
        if "vs_calibrated_range" in e:
            vs += " [{:.3f}-{:.3f}]".format(*e["vs_calibrated_range"])
        print(f"equal N: {e['method']} at {e['context']}, batch {e['batch']}: "
              f"{e['step_ms']:.2f} ms{vs}")
    for f in step_fit(records, equal):
        paper = (f" (paper {f['paper_fixed_ms']:.1f} ms + {f['paper_per_request_ms']:.3f} ms x N)"
                 if "paper_fixed_ms" in f else "")
        print(f"step fit: {f['method']} at {f['context']}: {f['fixed_ms']:.2f} ms + "
              f"{f['per_request_ms']:.3f} ms x N{paper}")
