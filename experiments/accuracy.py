"""Gradient-free accuracy study of the trained model: NIAH and MRCR across context lengths.

Gin header -- must be set: run.experiment, run.name, accuracy.model, accuracy.checkpoint.
Run (CPU, short lengths): lsparse run configs/experiments/accuracy.gin
Run (GPU, full table):    lsparse run configs/experiments/accuracy.gin \\
                            --gin.accuracy.lengths=(1024,2048,4096,8192) --gin.accuracy.examples=64
Writes runs/<name>/{config.gin, results.json, accuracy.png, table.md}.

Methods: "dense" (no sparsity: CSA layers attend to every eligible entry), "resident",
"hisparse", "leansparse_C<n>" (coarse top-n candidates, miss filter, exact rerank;
"leansparse_C<n>_w<s>_B<b>": the miss filter starts after s decode steps, a key cache of b
rows; LeanSparseConfig.warm_steps and key_cache_rows, default b = C; a "_seed" suffix seeds the
key caches at admission from the final prefill chunk's selections, README "Cold start") and
"direct_pq" (leansparse with C = k and no miss filter: the PQ coarse top-k, which exact scores
only order and against which the not-yet-paged tail competes). Every method shares one
prefill per example (prefill is the same computation for all of them) and decodes greedily.
Recall: a second, teacher-forced pass feeds every method the reference answer, so selections
are compared on identical contexts with resident's (exact top-k); records also keep the recall
of every decode step (``recall_by_step``: the caches start cold at admission).
Seeds: training examples use seeds >= TRAIN_SEED_BASE (1e9, training.data); evaluation
examples use seed_offset .. seed_offset + examples - 1, which must lie below CALIBRATION_SEED =
TRAIN_SEED_BASE - 1 (checked), so the evaluation set is disjoint from training by construction;
the PQ codebooks are calibrated on one more held-out prompt (seed CALIBRATION_SEED). The shipped
tables use seed_offset 0 (results/accuracy_gpu, 0..63) and 1_000_000 (results/accuracy_long);
any other offset draws a fresh example set.
Statistics: every cell's exact match carries a Wilson 95% interval (ci_low, ci_high); every
pair of methods of a cell an exact McNemar test on the same examples (results.json "cells" and
"mcnemar").
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import pyplot, run_dir, selection_recall, write_results
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_storage,
)
from lsparse_jax.methods.leansparse import calibrate_codebooks, seed_key_cache, seed_positions
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import forward_chunk, prefill
from lsparse_jax.tasks import score_exact, score_similarity, tokenizer
from lsparse_jax.training.data import TRAIN_SEED_BASE, task_example

CALIBRATION_SEED = TRAIN_SEED_BASE - 1
# leansparse_C<C>[_w<warm steps>][_B<key-cache rows>] (defaults: LeanSparseConfig's warm_steps,
# key_cache_rows = C)
_LEAN = re.compile(r"leansparse_C(\d+)(?:_w(\d+))?(?:_B(\d+))?(_seed)?$")
FIXED_METHODS = ("dense", "resident", "hisparse", "direct_pq")
TASKS = ("niah", "mrcr")
IMPLEMENTATIONS = ("xla", "triton", "jax_triton", "mosaic", None)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    engine_method: str | None  # None = dense (no engine)
    lean: LeanSparseConfig | None = None
    seed: bool = False  # leansparse: key caches seeded at admission (methods.leansparse)


def parse_method(name: str, top_k: int, miss_filter_offset: float | None) -> Method:
    """A method name -> how to run it. Raises ValueError for an unknown name."""
    if name == "dense":
        return Method(name, None)
    if name in ("resident", "hisparse"):
        return Method(name, name)
    if name == "direct_pq":
        return Method(name, "direct_pq", LeanSparseConfig(top_k, None, top_k))
    match = _LEAN.match(name)
    if match:
        c = int(match.group(1))
        if c < top_k:
            raise ValueError(f"accuracy: method {name!r} has C={c} < top-k={top_k}")
        warm = LeanSparseConfig.warm_steps if match.group(2) is None else int(match.group(2))
        rows = c if match.group(3) is None else int(match.group(3))
        if rows < c:
            raise ValueError(f"accuracy: method {name!r} has key-cache rows {rows} < C={c}")
        return Method(name, "leansparse", LeanSparseConfig(c, miss_filter_offset, rows,
                                                           warm_steps=warm),
                      seed=match.group(4) is not None)
    raise ValueError(f"accuracy: unknown method {name!r}; methods: dense, resident, hisparse, "
                     "direct_pq, leansparse_C<candidates>[_w<warm steps>][_B<key-cache rows>]"
                     "[_seed]")


def check_settings(model, checkpoint, tasks, lengths, examples, methods, num_slots,
                   prefill_chunk, hot_cache_rows, page_size, miss_filter_offset,
                   calibration_tokens, implementation, host_pages):
    """Validates every setting and the checkpoint path before any work; returns (the model with
    max_len fitted, the parsed methods, the checkpoint directory)."""
    v.names("accuracy.tasks", tasks, TASKS)
    lengths = v.integers("accuracy.lengths", lengths, lo=64)
    for setting, value in (("examples", examples), ("num_slots", num_slots),
                           ("prefill_chunk", prefill_chunk), ("page_size", page_size),
                           ("calibration_tokens", calibration_tokens)):
        v.integer(f"accuracy.{setting}", value)
    v.number("accuracy.miss_filter_offset", miss_filter_offset, lo=0.0, none_ok=True)
    v.choice("accuracy.implementation", implementation, IMPLEMENTATIONS)
    cfg = v.fit_model(model, max(lengths) + 16, "max(accuracy.lengths) + 16 answer tokens")
    top_k = cfg.indexer.top_k
    methods = v.sequence("accuracy.methods", methods, "('resident', 'leansparse_C64')")
    v.names("accuracy.methods", methods, lambda m: bool(_LEAN.match(m)) or m in FIXED_METHODS,
            extra=", ".join(repr(m) for m in FIXED_METHODS) + ", 'leansparse_C<candidates>'")
    try:
        specs = [parse_method(m, top_k, miss_filter_offset) for m in methods]
    except ValueError as err:
        raise v.ConfigError(f"accuracy.methods: {str(err).removeprefix('accuracy: ')}") from err
    if any(s.engine_method and method_storage(s.engine_method).kv_on_host for s in specs):
        v.integer("accuracy.hot_cache_rows", hot_cache_rows, lo=top_k)
        v.host_pages("accuracy.host_pages", host_pages, cfg, max(lengths) + 16, page_size,
                     min(num_slots, examples))
    for s in specs:
        if s.lean is not None and cfg.indexer.head_dim % s.lean.pq_subspace_dim:
            v.fail("LeanSparseConfig.pq_subspace_dim", s.lean.pq_subspace_dim,
                   f"must divide the indexer head_dim={cfg.indexer.head_dim}")
    return cfg, specs, v.checkpoint_path("accuracy.checkpoint", checkpoint)


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def evaluation_seeds(seed_offset: int, examples: int) -> range:
    """The example seeds of a study: seed_offset .. seed_offset + examples - 1. Raises
    ValueError unless they lie in [0, CALIBRATION_SEED), i.e. below every training seed."""
    if seed_offset < 0 or seed_offset + examples > CALIBRATION_SEED:
        raise ValueError(f"accuracy.seed_offset={seed_offset}: evaluation seeds seed_offset .. "
                         f"seed_offset + examples - 1 must lie in [0, {CALIBRATION_SEED}) "
                         f"(training uses seeds >= {TRAIN_SEED_BASE}, calibration "
                         f"{CALIBRATION_SEED})")
    return range(seed_offset, seed_offset + examples)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    Notation: k successes of n trials, p = k / n, z the normal quantile (1.96 for 95%).
    Math: center = (p + z^2 / 2n) / (1 + z^2 / n);
      half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2);
      interval = [center - half, center + half] (clipped to [0, 1]; n = 0 gives [0, 1]).
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar(a: np.ndarray, b: np.ndarray) -> dict:
    """Exact two-sided McNemar test of paired 0/1 outcomes a, b (same examples).

    Notation: n01 = #(a right, b wrong), n10 = #(a wrong, b right), n = n01 + n10.
    Math: under H0 the discordant pairs split Binomial(n, 1/2);
      p = min(1, 2 * sum_{i <= min(n01, n10)} C(n, i) / 2^n) (p = 1 when n = 0).
    """
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    n01, n10 = int(np.sum(a & ~b)), int(np.sum(~a & b))
    n = n01 + n10
    tail = sum(math.comb(n, i) for i in range(min(n01, n10) + 1)) / 2**n if n else 1.0
    return {"a_only": n01, "b_only": n10, "p": min(1.0, 2 * tail)}


def dense_decode(params, cfg, caches, last, start: int, steps: int) -> list[int]:
    """Greedy decoding with dense CSA attention from prefilled caches."""
    tok = int(jnp.argmax(last))
    out = [tok]
    for i in range(steps):
        logits, caches, _ = forward_chunk(params, cfg, caches, jnp.asarray([tok], jnp.int32),
                                          start + i, 1, True)
        tok = int(jnp.argmax(logits[0]))
        out.append(tok)
    return out


def enable_cache(directory) -> None:
    """JAX's persistent compilation cache in ``directory`` (created), for every compile that
    takes >= 0.5 s from now on."""
    import os

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def warm_engine(engine: Engine):
    """Compiles what a batch runs: prefill and decode step (``Engine.warmup``), then the
    admission and release of a prompt of a few full pages (not compiled by warmup: on the
    H200 they otherwise compiled one method after another inside the first batch)."""
    engine.warmup()
    cfg, cache = engine.config.model, engine.config.cache
    prompt = np.zeros(min(cache.prefill_chunk + 1, cfg.max_len - 1), np.int32)
    engine.release(engine.admit(prompt, 1))
    jax.block_until_ready(engine.state)


def compile_all(engines: dict):
    """Compiles every engine's prefill, admission and decode step, concurrently (XLA compiles
    outside the GIL, and on a GPU host compilation dominates a short study)."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(engines))) as pool:
        futures = {pool.submit(warm_engine, e): m for m, e in engines.items()}
        for future in tqdm(as_completed(futures), total=len(futures), desc="compile decode steps"):
            future.result()
            tqdm.write(f"accuracy: {futures[future]} compiled at "
                       f"{time.perf_counter() - began:.0f} s")


def prefill_with_selections(params, cfg, tokens, chunk: int):
    """``steps.prefill`` (the same chunks, the same jitted forward_chunk) that also returns
    the final chunk's selections: ((caches, last logits [V]), {CSA layer: [T_valid, k]})."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    caches, padded = empty_cache(cfg), jnp.pad(tokens, (0, -n % chunk))
    for start in range(0, n, chunk):
        valid = min(chunk, n - start)
        logits, caches, sels = forward_chunk(params, cfg, caches, padded[start:start + chunk],
                                             start, valid)
    final = {i: np.asarray(sels[i].positions[:valid]) for i, kind in enumerate(cfg.layer_pattern)
             if kind == "csa"}
    return (caches, logits[valid - 1]), final


def seed(engine: Engine, slot: int, prefilled, final: dict):
    """Seeds ``slot``'s leansparse key caches from the final prefill chunk's selections
    (methods.leansparse.seed_positions / seed_key_cache)."""
    caches, cfg = prefilled[0], engine.config.model
    paged = (int(engine.lengths[slot]) // cfg.csa_ratio) // engine.config.cache.page_size \
        * engine.config.cache.page_size
    for layer, sel in final.items():
        pos = seed_positions(sel, engine.config.leansparse.key_cache_rows)
        keys = caches[layer].keys
        engine.state = seed_key_cache(engine.state, layer, slot, jnp.asarray(pos), keys.values,
                                      keys.scales, paged)


def run_engine(engine: Engine, batch, prefilled, answers, forced: bool, finals=None):
    """Admits a batch, decodes len(answer) tokens each; returns (texts, selections [steps, S,
    L, k]). Forced: inputs are the reference answers (teacher forcing). finals: per example
    the final prefill chunk's selections, to seed the key caches at admission (None: cold)."""
    steps = max(len(a) for a in answers) - 1
    slots = [engine.admit(ex.prompt, steps + 1, prefilled=p) for ex, p in zip(batch, prefilled)]
    if finals is not None:
        for s, p, f in zip(slots, prefilled, finals):
            seed(engine, s, p, f)
    sels = []
    for i in range(steps):
        tokens = None
        if forced:
            tokens = np.zeros(engine.active.shape, np.int32)
            for s, ans in zip(slots, answers):
                tokens[s] = ans[min(i, len(ans) - 1)]
        sels.append(np.asarray(engine.step(tokens).selected)[slots])
    texts = [tokenizer.decode(engine.release(s)) for s in slots]
    return texts, np.stack(sels) if sels else None


@gin.configurable
def accuracy(name: str, model=gin.REQUIRED, checkpoint: str = gin.REQUIRED,
             tasks=("niah", "mrcr"), lengths=(1024, 2048), examples: int = 16,
             methods=("dense", "resident", "hisparse", "leansparse_C64", "leansparse_C128",
                      "leansparse_C2048", "leansparse_C4096", "direct_pq"),
             num_slots: int = 8, prefill_chunk: int = 1024, hot_cache_rows: int = 64,
             page_size: int = 64, miss_filter_offset: float | None = 1.0,
             calibration_tokens: int = 4096, implementation: str | None = "xla",
             host_pages: int | None = None, seed_offset: int = 0, recall: bool = True,
             compilation_cache: str | None = None):
    """Runs every method on the same held-out examples of every (task, length) cell.
    host_pages: CacheConfig.host_pages of the paged methods (None = enough for every slot).
    seed_offset: the first example seed (evaluation_seeds); another offset, a fresh example set.
    recall: also run the teacher-forced pass that measures indexer recall (doubles decoding).
    compilation_cache: a directory for JAX's persistent compilation cache (enable_cache; the
    environment variable JAX_COMPILATION_CACHE_DIR does the same): a later run with the same
    shapes loads its compiled steps instead of compiling them (on a GPU, most of a short
    study's time); carry the directory between machines to keep it.
    Examples run num_slots at a time: every method's engine is compiled once (at max(lengths))
    and reused by every batch and length, so fewer slots compile faster and only add batches.
    Cells run length by length (both tasks of a length, then the next), so a run cut short
    keeps every shorter length."""
    if compilation_cache is not None:  # before anything compiles
        enable_cache(v.resolve_path("accuracy.compilation_cache", compilation_cache, None))
    cfg, specs, path = check_settings(model, checkpoint, tasks, lengths, examples, methods,
                                      num_slots, prefill_chunk, hot_cache_rows, page_size,
                                      miss_filter_offset, calibration_tokens, implementation,
                                      host_pages)
    v.integer("accuracy.seed_offset", seed_offset, lo=0)
    measure_recall = v.flag("accuracy.recall", recall)
    try:
        seeds = evaluation_seeds(seed_offset, examples)
    except ValueError as err:
        raise v.ConfigError(str(err)) from err
    params = v.load_checkpoint("accuracy.checkpoint", path, cfg)
    codebooks = None
    if any(s.engine_method and method_storage(s.engine_method).keys_on_host for s in specs):
        calib = task_example("niah", calibration_tokens, CALIBRATION_SEED)
        codebooks = calibrate_codebooks(params, cfg, calib.prompt, seed=0)
    engines = {}
    for s in specs:
        if s.engine_method is None:
            continue
        paged = method_storage(s.engine_method).kv_on_host
        cache = CacheConfig(num_slots, prefill_chunk, hot_cache_rows if paged else None,
                            page_size, host_pages=host_pages if paged else None)
        engines[s.name] = Engine(EngineConfig(
            model=cfg, cache=cache, sampling=SamplingConfig(0.0, 0), method=s.engine_method,
            leansparse=s.lean or LeanSparseConfig(), implementation=implementation),
            params, codebooks)

    compile_all(engines)
    records = []  # one per (task, length, example, method)
    cells = [(t, n) for n in lengths for t in tasks]
    bar = tqdm(total=len(cells) * examples, desc="accuracy", unit="example")
    for task, length in cells:
        for lo in range(0, examples, num_slots):
            batch = [task_example(task, length, seed) for seed in seeds[lo:lo + num_slots]]
            answers = [tokenizer.encode(ex.answer) for ex in batch]
            t0 = time.perf_counter()
            if any(s.seed for s in specs):  # the same prefill, keeping its final selections
                prefilled, finals = zip(*[prefill_with_selections(params, cfg, ex.prompt,
                                                                  prefill_chunk) for ex in batch])
            else:
                prefilled, finals = [prefill(params, cfg, ex.prompt, prefill_chunk)
                                     for ex in batch], None
            jax.block_until_ready(prefilled)
            timing = {"prefill": time.perf_counter() - t0}
            reference = None
            for s in specs:
                t0 = time.perf_counter()
                if s.engine_method is None:
                    texts = [tokenizer.decode(dense_decode(params, cfg, c, last,
                                                           len(ex.prompt), len(a) - 1))
                             for ex, (c, last), a in zip(batch, prefilled, answers)]
                    recall = by_step = [None] * len(batch)
                else:
                    fin = finals if s.seed else None
                    texts, _ = run_engine(engines[s.name], batch, prefilled, answers, False, fin)
                    sel = None
                    if measure_recall:
                        _, sel = run_engine(engines[s.name], batch, prefilled, answers, True,
                                            fin)
                    if s.name == "resident":
                        reference = sel
                    recall = [None if reference is None or sel is None else
                              selection_recall(sel[:, j], reference[:, j])
                              for j in range(len(batch))]
                    by_step = [None if reference is None or sel is None else
                               [selection_recall(sel[t, j], reference[t, j])
                                for t in range(sel.shape[0])] for j in range(len(batch))]
                for j, (ex, text) in enumerate(zip(batch, texts)):
                    records.append(dict(task=task, length=length, seed=seeds[lo + j],
                                        method=s.name,
                                        generated=text, answer=ex.answer,
                                        exact=score_exact(text, ex.answer),
                                        similarity=score_similarity(text, ex.answer),
                                        recall=recall[j], recall_by_step=by_step[j]))
                timing[s.name] = time.perf_counter() - t0
            tqdm.write(f"accuracy: {task}@{length} seeds {seeds[lo]}.."
                       f"{seeds[lo] + len(batch) - 1}: " +
                       ", ".join(f"{k} {v:.1f} s" for k, v in timing.items()))
            bar.update(len(batch))
            # after every batch: a run cut short keeps its finished cells (n = examples) and
            # the examples of the cell it was in (n < examples)
            done = sorted(cells[:cells.index((task, length)) + 1],
                          key=lambda c: (tasks.index(c[0]), c[1]))  # the table: task by task
            summary, table = save(name, cfg, checkpoint, examples, records, methods, done,
                                  complete=len(done) == len(cells)
                                  and lo + num_slots >= examples, seeds=seeds)
        finished = [n for n in lengths if all((t, n) in done for t in tasks)]
        if finished and finished[-1] == length and task == tasks[-1]:
            plot(summary, methods, tasks, finished, run_dir(name) / "accuracy.png")
    bar.close()
    print(table)
    out = run_dir(name)
    print(f"wrote {out}/results.json, table.md and accuracy.png")
    return summary


def save(name, cfg, checkpoint, examples, records, methods, cells, complete: bool,
         seeds: range = range(0)):
    """Writes the results of ``cells`` (after every batch: a long run that stops early keeps
    what it measured, marked complete=False; a cell cut short has n < examples)."""
    summary = summarize(records, methods, cells)
    table = format_table(summary, methods, cells)
    out = run_dir(name)
    write_results(out, {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
                        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                        "examples_per_cell": examples, "complete": complete,
                        "evaluation_seeds": [seeds.start, seeds.stop],
                        "training_seeds": f">= {TRAIN_SEED_BASE}",
                        "cells": cell_records(summary, methods, cells),
                        "mcnemar": pair_records(records, methods, cells),
                        "summary": summary, "table": table, "records": records})
    (out / "table.md").write_text(table + "\n")
    return summary, table


def cell_records(summary, methods, cells) -> list[dict]:
    """One record per (task, length, method): exact, n, ci_low, ci_high, similarity, recall."""
    return [{"task": t, "length": n, "method": m,
             **{k: summary[f"{t}@{n}"][m][k] for k in ("exact", "n", "ci_low", "ci_high",
                                                      "similarity", "recall")}}
            for t, n in cells for m in methods]


def pair_records(records, methods, cells) -> list[dict]:
    """One record per (task, length, method a, method b), a before b in ``methods``: the exact
    McNemar test of their outcomes on the same examples (a_only: a right and b wrong)."""
    out = []
    for t, n in cells:
        outcome = {m: [r["exact"] for r in sorted(records, key=lambda r: r["seed"])
                       if r["task"] == t and r["length"] == n and r["method"] == m]
                   for m in methods}
        out += [{"task": t, "length": n, "a": a, "b": b, **mcnemar(outcome[a], outcome[b])}
                for i, a in enumerate(methods) for b in methods[i + 1:]]
    return out


def summarize(records, methods, cells) -> dict:
    """Per cell and method: exact-match accuracy with its Wilson 95% interval, similarity,
    recall; McNemar vs resident (and vs dense) per cell."""
    out = {}
    for task, length in cells:
        key = f"{task}@{length}"
        mine = {m: [r for r in records if r["task"] == task and r["length"] == length
                    and r["method"] == m] for m in methods}
        cell = {}
        for m, rs in mine.items():
            rec = [r["recall"] for r in rs if r["recall"] is not None]
            hits = int(sum(r["exact"] for r in rs))
            lo, hi = wilson(hits, len(rs))
            cell[m] = {"exact": hits / max(len(rs), 1), "ci_low": lo, "ci_high": hi,
                       "similarity": float(np.mean([r["similarity"] for r in rs])),
                       "recall": float(np.mean(rec)) if rec else None, "n": len(rs)}
            for ref in ("resident", "dense"):
                if ref in mine and m != ref:
                    cell[m][f"mcnemar_vs_{ref}"] = mcnemar(
                        [r["exact"] for r in rs], [r["exact"] for r in mine[ref]])
        out[key] = cell
    return out


def format_table(summary, methods, cells) -> str:
    """Markdown: one row per method, one column per cell: exact % (recall)."""
    head = "| method | " + " | ".join(f"{t} {n // 1024}K" if n % 1024 == 0 else f"{t} {n}"
                                       for t, n in cells) + " |"
    lines = [head, "|" + "---|" * (len(cells) + 1)]
    for m in methods:
        row = []
        for t, n in cells:
            c = summary[f"{t}@{n}"][m]
            text = f"{100 * c['exact']:.1f} [{100 * c['ci_low']:.1f}, {100 * c['ci_high']:.1f}]"
            if t == "mrcr":
                text += f" / {c['similarity']:.2f}"
            if c["recall"] is not None and m != "resident":
                text += f" (r {c['recall']:.3f})"
            p = c.get("mcnemar_vs_resident", {}).get("p")
            if p is not None and p < 0.05:
                text += " *"
            row.append(text)
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Cells: exact-match % [Wilson 95% interval] (MRCR: / mean similarity), (r: "
                 "indexer recall of resident's top-k under teacher forcing); * = McNemar p < "
                 "0.05 vs resident.")
    return "\n".join(lines)


def plot(summary, methods, tasks, lengths, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, m in enumerate(methods):
            dodge = 2 ** (0.05 * (i - (len(methods) - 1) / 2))  # methods side by side
            cs = [summary[f"{task}@{n}"][m] for n in lengths]
            ys = np.array([100 * c["exact"] for c in cs])
            err = np.array([[y - 100 * c["ci_low"] for y, c in zip(ys, cs)],
                            [100 * c["ci_high"] - y for y, c in zip(ys, cs)]])
            ax.errorbar([n * dodge for n in lengths], ys, yerr=err, fmt="o-", capsize=3,
                        label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("exact match % (Wilson 95%)")
        ax.set_ylim(-2, 102)
        ax.set_title(task)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
