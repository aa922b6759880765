"""Speculative decoding (DFlash-style drafter, serving/speculative.py) vs plain decoding, per
method and concurrency, on the trained model.

Gin header -- must be set: run.experiment, run.name, speculative.model, speculative.checkpoint.
Run (GPU): lsparse run configs/experiments/speculative.gin; the V4-slice cost side (random
weights, ``checkpoint=None``, an untrained drafter): configs/experiments/speculative_v4.gin
Writes runs/<name>/{config.gin, results.json, speculative.png} and copies results.json to
``speculative.results_dir`` (default results/speculative/).

For each method and concurrency C, C held-out NIAH prompts are admitted at once and each
decodes ``decode_tokens`` tokens greedily, once plainly and once speculatively (the same
prompts): output tokens/s over the decode phase (drafting and verification included), mean
acceptance length (tokens emitted per verification), the union-miss ratio (host rows fetched
once per verification block over the sum of each query's own misses), the drafter's time
share, and whether the speculative tokens equal the plain ones (greedy-exact; where not, each
request's first differing token index, ``first_divergence``). Without a
drafter checkpoint an untrained drafter runs (the cost side: acceptance ~1); without a target
checkpoint (``checkpoint=None``) the target has random weights of seed 0 (shapes only: its NIAH
answers mean nothing, its greedy tokens still must equal plain decoding's).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import gin
import jax
import numpy as np

from experiments import validate as v
from experiments.common import fill_added_fields, pyplot, run_dir, write_results
from lsparse_jax.config import (
    CacheConfig,
    DrafterConfig,
    EngineConfig,
    LeanSparseConfig,
    ModelConfig,
    SamplingConfig,
    method_storage,
)
from lsparse_jax.model import init_params
from lsparse_jax.model.drafter import init_drafter
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.speculative import SpecEngine, check_spec
from lsparse_jax.training.data import task_example

METHODS = ("resident", "hisparse", "leansparse", "adaptive")
IMPLEMENTATIONS = ("xla", "triton", "jax_triton", "mosaic", None)


def _config(method, cfg, slots, chunk, hot_rows, page, optional_pages, implementation, lean):
    storage = method_storage(method)
    return EngineConfig(
        model=cfg, method=method, sampling=SamplingConfig(0.0, 0), implementation=implementation,
        leansparse=lean,
        cache=CacheConfig(slots, chunk, hot_rows if storage.kv_on_host else None, page,
                          optional_pages=optional_pages if storage.lent_pages else None))


TOP = 8  # record_margins: the plain run's top logits kept per step and request


@jax.jit
def _top(logits):
    return jax.lax.top_k(logits, TOP)


def serve_prompts(engine, prompts, decode_tokens, margins: bool = False):
    """Admits every prompt, decodes until each has decode_tokens tokens (the first one from
    the prefill); returns the tokens per request, the mean time to first token, and with
    ``margins`` each request's top-``TOP`` (token ids, logits) of every decode step (entry
    j - 1 made token j; None without)."""
    engine.warmup()
    # admission compiles on its first use (not in warmup): admit and release one prompt of a
    # few pages first, so that the time to first token excludes compilation
    cfg, chunk = engine.config.model, engine.config.cache.prefill_chunk
    engine.release(engine.admit(np.zeros(min(chunk + 1, cfg.max_len - 1), np.int32), 1))
    slots = [engine.admit(p, decode_tokens) for p in prompts]
    ttft = [engine.requests[s].first_token_at - engine.requests[s].admitted_at for s in slots]
    out, tops = {}, {s: [] for s in slots}
    while engine.active.any():
        live = np.flatnonzero(engine.active)
        step = engine.step()
        if margins:  # after the engine's timed step: its tok/s does not include this
            vals, ids = (np.asarray(a) for a in _top(step.logits))
            for s in live:
                tops[s].append((ids[s], vals[s]))
        for s in np.flatnonzero(engine.active):
            if engine.requests[s].done or engine.lengths[s] >= engine.limit[s]:
                out[s] = engine.release(s)
    return ([out[s] for s in slots], float(np.mean(ttft)),
            [tops[s] for s in slots] if margins else None)


def first_divergence(got: list, want: list) -> list[int | None]:
    """Per request, the index of the first token where ``got`` departs from ``want`` (a
    shorter sequence departs where it ends); None where they are equal."""
    out = []
    for g, w in zip(got, want, strict=True):
        g, w = list(g), list(w)
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        out.append(None if g == w else same)
    return out


def divergence_margins(got: list, want: list, tops: list) -> list[dict | None]:
    """Per request, where the speculative tokens ``got`` first depart from the plain ones
    ``want``, with the plain run's logits there (``tops``: ``serve_prompts``'s margins of the plain
    run): the index j, both tokens, ``logit_gap`` = plain logit of its token - plain logit of
    the speculative token (None: the speculative token is not in the plain top ``TOP``), and
    ``top2_gap`` = plain top-1 - top-2 logit. A gap near 0 is a near tie that rounding can flip;
    a large one, or a token outside the top, is a real departure. None where equal; j = 0 (the
    prefill's token) has no step logits (gaps None)."""
    out = []
    for j, g, w, top in zip(first_divergence(got, want), got, want, tops, strict=True):
        if j is None:
            out.append(None)
            continue
        g, w = list(g), list(w)
        rec = {"index": j, "plain_token": int(w[j]) if j < len(w) else None,
               "spec_token": int(g[j]) if j < len(g) else None, "logit_gap": None,
               "top2_gap": None}
        if 1 <= j <= len(top) and rec["plain_token"] is not None:
            ids, vals = (list(map(int, top[j - 1][0])), [float(v) for v in top[j - 1][1]])
            if ids[0] != rec["plain_token"]:
                raise ValueError(f"divergence_margins: step {j - 1}'s top token {ids[0]} is "
                                 f"not the plain token {rec['plain_token']}: tops misaligned")
            rec["top2_gap"] = vals[0] - vals[1]
            if rec["spec_token"] in ids:
                rec["logit_gap"] = vals[0] - vals[ids.index(rec["spec_token"])]
        out.append(rec)
    return out


@gin.configurable
def speculative(name: str, model=gin.REQUIRED, checkpoint: str | None = gin.REQUIRED,
                drafter_checkpoint: str | None = None, drafter: DrafterConfig | None = None,
                methods=METHODS, concurrencies=(1, 2, 4, 8), prompt_tokens: int = 4096,
                decode_tokens: int = 128, prefill_chunk: int = 1024, hot_cache_rows: int = 128,
                page_size: int = 16, optional_pages: int = 512,
                num_candidates: int = 64, key_cache_rows: int = 256,
                implementation: str | None = None, codebook_tokens: int = 4096,
                results_dir: str | None = "results/speculative",
                time_limit_s: float | None = None, resume_from: str | None = None,
                record_margins: bool = False, repeats: int = 1):
    """checkpoint: the target's checkpoint; None = random weights (seed 0: the cost side at
    shapes no checkpoint exists for). drafter_checkpoint: a trained drafter
    (experiments/train_drafter.py); None = an untrained one of config ``drafter``.
    num_candidates, key_cache_rows: leansparse's C and key cache (miss filter off: its
    selection is then independent of the key-cache order).
    Cells run concurrency by concurrency (every method at the first one first); results are
    written after each cell; time_limit_s: start no cell after this many seconds (the results
    say ``complete: false``). resume_from: a results.json of an earlier run with the same
    model, checkpoints, lengths and implementation: its finished cells (plain and speculative
    records of one method and concurrency) are kept and not run again; each record carries the
    ``session`` (run name @ UTC start) that measured it. record_margins: keep the plain run's
    top logits each step and record, where speculative tokens depart, the plain logit gap
    there (``divergences``; the top-k after each step adds a little to the plain run).
    repeats: serving runs of a cell's prompts per engine, plain and speculative alternating on
    the same (warm) engines: tok/s of each run in ``output_tok_s_runs``, their median in
    ``output_tok_s``, each pair's ratio in the speculative record's ``speedup_runs``, and
    ``runs_identical`` (every rerun emitted the first plain run's tokens)."""
    for setting, value in (("prompt_tokens", prompt_tokens), ("decode_tokens", decode_tokens),
                           ("prefill_chunk", prefill_chunk), ("page_size", page_size),
                           ("optional_pages", optional_pages),
                           ("codebook_tokens", codebook_tokens), ("repeats", repeats)):
        v.integer(f"speculative.{setting}", value)
    methods = v.names("speculative.methods", methods, METHODS)
    concurrencies = v.integers("speculative.concurrencies", concurrencies)
    v.choice("speculative.implementation", implementation, IMPLEMENTATIONS)
    v.number("speculative.time_limit_s", time_limit_s, lo=0, none_ok=True)
    cfg = v.fit_model(model, prompt_tokens + decode_tokens + 1,
                      "speculative.prompt_tokens + decode_tokens + 1")
    path = None if checkpoint is None else v.checkpoint_path("speculative.checkpoint",
                                                             checkpoint)
    if drafter_checkpoint is not None:
        dpath = v.checkpoint_path("speculative.drafter_checkpoint", drafter_checkpoint)
        from lsparse_jax.training.drafter import load_drafter

        dparams, dcfg = load_drafter(dpath)
    else:
        v.instance("speculative.drafter", drafter, DrafterConfig, "@DrafterConfig()")
        dcfg, dparams = drafter, init_drafter(cfg, drafter, 0)
    lean = LeanSparseConfig(num_candidates, None, key_cache_rows)
    try:
        for m in methods:
            check_spec(_config(m, cfg, 1, prefill_chunk, hot_cache_rows, page_size,
                               optional_pages, implementation, lean), dcfg)
    except ValueError as err:
        raise v.ConfigError(f"speculative: {err}") from err
    params = (init_params(cfg, 0) if path is None
              else v.load_checkpoint("speculative.checkpoint", path, cfg))
    books = None
    if "leansparse" in methods:
        from lsparse_jax.methods.leansparse import calibrate_codebooks

        calib = task_example("niah", codebook_tokens, 10**6).prompt  # not an evaluation seed
        books = calibrate_codebooks(params, cfg, calib)

    out, start = run_dir(name), time.perf_counter()
    session = f"{out.name}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    meta = {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
            "drafter_checkpoint": drafter_checkpoint, "drafter": dataclasses.asdict(dcfg),
            "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
            "implementation": implementation, "repeats": repeats}
    cells = [(m, c) for c in concurrencies for m in methods]
    records = [] if resume_from is None else resumed(resume_from, meta, cells)
    done = {(r["method"], r["concurrency"]) for r in records}
    for i, (method, c) in enumerate(cells):
        if (method, c) in done:
            continue
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            print(f"time limit: {len(cells) - i} cells not run")
            break
        prompts = [task_example("niah", prompt_tokens, seed).prompt for seed in range(c)]
        config = _config(method, cfg, c, prefill_chunk, hot_cache_rows, page_size,
                         optional_pages, implementation, lean)
        plain = Engine(config, params, books)
        want, ttft, tops = serve_prompts(plain, prompts, decode_tokens, record_margins)
        spec = SpecEngine(config, params, (dparams, dcfg), books)
        got, spec_ttft, _ = serve_prompts(spec, prompts, decode_tokens)
        plain_runs, spec_runs = [rate(plain, (0, 0.0))], [rate(spec, (0, 0.0))]
        same = True
        for _ in range(repeats - 1):
            for engine, runs in ((plain, plain_runs), (spec, spec_runs)):
                before = (engine.decode_tokens, engine.decode_seconds)
                again, _, _ = serve_prompts(engine, prompts, decode_tokens)
                runs.append(rate(engine, before))
                same = same and again == want
        pm = plain.metrics()
        records.append({"method": method, "concurrency": c, "speculative": False,
                        "acceptance_length": 1.0,
                        "output_tok_s": float(np.median(plain_runs)),
                        "output_tok_s_runs": plain_runs,
                        "union_miss_ratio": None, "ttft_s": ttft,
                        "decode_tokens": pm["decode_tokens"], "session": session})
        sm = spec.metrics()
        # the drafter timed apart (the served run queues verification behind drafting)
        sm["drafter_time_share"] = spec.drafter_seconds() * sm["steps"] / max(
            sm["decode_seconds"], 1e-9)
        records.append({"method": method, "concurrency": c, "speculative": True,
                        "acceptance_length": sm["acceptance_length"],
                        "acceptance_histogram": sm["acceptance_histogram"],
                        "output_tok_s": float(np.median(spec_runs)),
                        "output_tok_s_runs": spec_runs,
                        "speedup_runs": [a / b for a, b in zip(spec_runs, plain_runs)],
                        "runs_identical": same,
                        "union_miss_ratio": sm["union_miss_ratio"],
                        "union_miss_rows": sm["union_miss_rows"],
                        "query_miss_rows": sm["query_miss_rows"],
                        "selection_union_ratio": sm["selection_union_ratio"],
                        "drafter_time_share": sm["drafter_time_share"], "ttft_s": spec_ttft,
                        "spec_state_bytes_per_request": sm["spec_state_bytes_per_request"],
                        "decode_tokens": sm["decode_tokens"],
                        "greedy_identical": got == want,
                        "first_divergence": first_divergence(got, want),
                        "divergences": (divergence_margins(got, want, tops) if record_margins
                                        else None), "session": session})
        print(table(records[-2:]).splitlines()[-1])
        save(out, results_dir, records, len(records) == 2 * len(cells), meta)
    save(out, results_dir, records, len(records) == 2 * len(cells), meta)
    print(table(records))
    print(f"wrote {out}/results.json and speculative.png")
    return records


def rate(engine, before: tuple[int, float]) -> float:
    """Decode tok/s of ``engine`` since ``before`` = (decode_tokens, decode_seconds)."""
    return (engine.decode_tokens - before[0]) / max(engine.decode_seconds - before[1], 1e-9)


def resumed(resume_from: str, meta: dict, cells) -> list[dict]:
    """The finished cells' records of an earlier results.json among ``cells``; a ConfigError
    when it was run with another setting of ``meta``."""
    path = v.resolve_path("speculative.resume_from", resume_from)
    prev = json.loads(path.read_text())
    now = json.loads(json.dumps(meta))
    prev.setdefault("repeats", 1)  # results written before repeats existed ran one each
    for key, cls in (("model", ModelConfig), ("drafter", DrafterConfig)):
        if isinstance(prev.get(key), dict):  # fields added since count at their default
            prev[key] = fill_added_fields(prev[key], now[key], cls)
    differs = [k for k, val in now.items() if prev.get(k) != val]
    if differs:
        raise v.ConfigError(f"speculative.resume_from: {path} was run with other {differs}; "
                            "resume only a run of the same settings")
    pairs = {}
    for r in prev["records"]:
        pairs.setdefault((r["method"], r["concurrency"]), []).append(r)
    return [r for cell in cells for r in pairs.get(cell, ())
            if len(pairs[cell]) == 2]  # a plain and a speculative record


def save(out, results_dir, records, complete: bool, meta: dict):
    write_results(out, {**meta, "complete": complete, "records": records})
    plot(records, out / "speculative.png")
    if results_dir is not None:
        dest = v.resolve_path("speculative.results_dir", results_dir, None)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "results.json", dest / "results.json")
        shutil.copy(out / "speculative.png", dest / "speculative.png")


def table(records) -> str:
    """Per method and concurrency: plain and speculative tok/s, speed-up, acceptance."""
    rows = ["    method   C  plain_tok_s  spec_tok_s  speedup  runs_range  acceptance  union/sum"
            "  sel_u/s  identical  first_divergence"]
    plain = {(r["method"], r["concurrency"]): r for r in records if not r["speculative"]}
    for r in records:
        if not r["speculative"]:
            continue
        p = plain[(r["method"], r["concurrency"])]
        ratio, sel = r["union_miss_ratio"], r.get("selection_union_ratio")  # sel: session 24+
        runs = r.get("speedup_runs") or []  # repeats > 1: the pairs' lowest and highest ratio
        spread = f"{min(runs):.2f}-{max(runs):.2f}" if len(runs) > 1 else "-"
        rows.append(f"{r['method']:>10} {r['concurrency']:>3} {p['output_tok_s']:12.1f} "
                    f"{r['output_tok_s']:11.1f} {r['output_tok_s'] / p['output_tok_s']:8.2f} "
                    f"{spread:>11} "
                    f"{r['acceptance_length']:11.2f} "
                    f"{'n/a' if ratio is None else f'{ratio:.2f}':>10} "
                    f"{'n/a' if sel is None else f'{sel:.2f}':>8} "
                    f"{str(r['greedy_identical']):>10}  {r.get('first_divergence')}"
                    + _gaps(r.get("divergences")))
    return "\n".join(rows)


def _gaps(divergences) -> str:
    """' gaps [...]': each departure's plain logit gap (>top: outside the plain top)."""
    if not divergences or all(d is None for d in divergences):
        return ""
    cells = ["-" if d is None else ">top" if d["logit_gap"] is None else f"{d['logit_gap']:.3g}"
             for d in divergences]
    return f"  gaps [{', '.join(cells)}]"


def plot(records, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in sorted({r["method"] for r in records}):
        for spec, style in ((False, "--"), (True, "-")):
            pts = sorted((r["concurrency"], r["output_tok_s"]) for r in records
                         if r["method"] == method and r["speculative"] == spec)
            ax.plot(*zip(*pts), style, marker="o",
                    label=f"{method}{' + drafter' if spec else ''}")
    ax.set_xlabel("concurrency (requests decoded together)")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
