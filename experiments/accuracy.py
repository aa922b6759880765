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
key caches at admission from the final prefill chunk's selections, README "Cold start"; a
"_fp8" suffix scores the coarse pass in FP8, LeanSparseConfig.coarse_precision; "_pq<d>" codes
d dims per PQ subvector, LeanSparseConfig.pq_subspace_dim, default 4) and
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
import hashlib
import json
import math
import pathlib
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import (
    fill_added_fields,
    pyplot,
    results_json,
    run_dir,
    selection_recall,
    write_results,
)
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    ModelConfig,
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
_LEAN = re.compile(r"leansparse_C(\d+)(?:_w(\d+))?(?:_B(\d+))?(_seed)?(_fp8)?(?:_pq(\d+))?$")
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
        precision = "fp8" if match.group(5) else LeanSparseConfig.coarse_precision
        sub = LeanSparseConfig.pq_subspace_dim if match.group(6) is None else int(match.group(6))
        if sub < 1:
            raise ValueError(f"accuracy: method {name!r} has pq_subspace_dim {sub} < 1")
        return Method(name, "leansparse", LeanSparseConfig(c, miss_filter_offset, rows,
                                                           pq_subspace_dim=sub,
                                                           warm_steps=warm,
                                                           coarse_precision=precision),
                      seed=match.group(4) is not None)
    raise ValueError(f"accuracy: unknown method {name!r}; methods: dense, resident, hisparse, "
                     "direct_pq, leansparse_C<candidates>[_w<warm steps>][_B<key-cache rows>]"
                     "[_seed][_fp8][_pq<d>]")


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


def paired_difference(ref: np.ndarray, other: np.ndarray, z: float = Z95) -> dict:
    """Difference of two paired proportions, other - ref, with Newcombe's hybrid score interval
    for paired data (Newcombe 1998, method 10): the interval the study uses to say how close a
    method is to resident on the same examples.

    Notation: n pairs; a = both right, b = ref only, c = other only, d = both wrong;
      p1 = (a + c) / n (other), p2 = (a + b) / n (ref), theta = p1 - p2 = (c - b) / n;
      [l_i, u_i] the Wilson intervals of p_i; phi = (a d - b c) / sqrt((a+b)(c+d)(a+c)(b+d)),
      0 when a margin is empty.
    Math: delta = sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2),
      eps = sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2),
      interval = [theta - delta, theta + eps].
    """
    x, y = np.asarray(ref, bool), np.asarray(other, bool)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired_difference: need equal, non-empty outcome vectors, got "
                         f"{x.shape} and {y.shape}")
    n = x.size
    a, b = int(np.sum(x & y)), int(np.sum(x & ~y))
    c, d = int(np.sum(~x & y)), int(np.sum(~x & ~y))
    p1, p2 = (a + c) / n, (a + b) / n
    (l1, u1), (l2, u2) = wilson(a + c, n, z), wilson(a + b, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    eps = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    theta = p1 - p2
    return {"diff": theta, "diff_low": theta - delta, "diff_high": theta + eps}


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
    H200 they otherwise compiled one method after another inside the first batch). The
    completed-page writeback is left to compile at its first use: the study's prompts are
    whole pages long and its answers shorter than a page, so it never runs (its warmup, one
    unrolled program per padded width up to num_slots, took most of the H200's compile time
    at 100-200 slots: ``PoolController.warmup``)."""
    engine.warmup(writeback=False)
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


def run_engine(engine: Engine, batch, prefilled, answers, forced: bool, finals=None,
               selections: bool = True, timing: dict | None = None):
    """Admits a batch, decodes len(answer) tokens each; returns (texts, selections [steps, S,
    L, k], None with selections=False: no per-step read of them). Forced: inputs are the
    reference answers (teacher forcing). finals: per example the final prefill chunk's
    selections, to seed the key caches at admission (None: cold). timing: filled with the
    seconds of admission, decoding and release."""
    t0 = time.perf_counter()
    steps = max(len(a) for a in answers) - 1
    slots = [engine.admit(ex.prompt, steps + 1, prefilled=p) for ex, p in zip(batch, prefilled)]
    if finals is not None:
        for s, p, f in zip(slots, prefilled, finals):
            seed(engine, s, p, f)
    t1 = time.perf_counter()
    sels = []
    for i in range(steps):
        tokens = None
        if forced:
            tokens = np.zeros(engine.active.shape, np.int32)
            for s, ans in zip(slots, answers):
                tokens[s] = ans[min(i, len(ans) - 1)]
        out = engine.step(tokens)  # reads the step's tokens (the next step feeds them)
        if selections:
            sels.append(np.asarray(out.selected)[slots])
    t2 = time.perf_counter()
    texts = [tokenizer.decode(engine.release(s)) for s in slots]
    jax.block_until_ready(engine.state)
    if timing is not None:
        timing.update(admit=t1 - t0, decode=t2 - t1, release=time.perf_counter() - t2)
    return texts, np.stack(sels) if sels else None


def checkpoint_digest(path: pathlib.Path) -> str:
    """SHA-256 of a checkpoint directory's files (relative paths and bytes): the same path
    after a retraining is another model."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0")
        digest.update(f.read_bytes())
    return digest.hexdigest()


def study_settings(cfg, checkpoint, path, num_slots, prefill_chunk, hot_cache_rows, page_size,
                   miss_filter_offset, calibration_tokens, implementation, host_pages,
                   recall) -> dict:
    """What every record of a study depends on besides (task, length, method, seed): a
    resumed run must match it exactly (JSON form, as results.json stores it). ``path``: the
    checkpoint directory, whose content is part of it (``checkpoint_digest``)."""
    settings = {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
                "checkpoint_sha256": checkpoint_digest(path),
                "num_slots": num_slots, "prefill_chunk": prefill_chunk,
                "hot_cache_rows": hot_cache_rows, "page_size": page_size,
                "miss_filter_offset": miss_filter_offset,
                "calibration_tokens": calibration_tokens, "implementation": implementation,
                "host_pages": host_pages, "recall": recall,
                "device": jax.devices()[0].device_kind}
    return json.loads(json.dumps(settings, default=str))


def resumed_records(path: pathlib.Path, settings: dict, tasks, lengths, methods,
                    seeds: range) -> list[dict]:
    """The records of an earlier run of this study (``path``: its results.json) that this run
    keeps: those of every (task, length, method) group it finished for all of ``seeds``
    (a group cut short is run again). Raises ConfigError if the earlier run used other
    settings (``study_settings``): its records would not be comparable."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    if isinstance((old.get("settings") or {}).get("model"), dict):  # fields added since
        old["settings"]["model"] = fill_added_fields(old["settings"]["model"],
                                                     settings["model"], ModelConfig)
    if old.get("settings") != settings:
        theirs = old.get("settings") or {}
        differ = sorted(k for k in set(settings) | set(theirs)
                        if settings.get(k) != theirs.get(k))
        v.fail("accuracy.resume", True,
               f"{path} was written with other settings ({', '.join(differ)}); move it away "
               "or set accuracy.resume=False to start afresh")
    want = set(seeds)
    keep = [r for r in old.get("records", []) if r["task"] in tasks and r["length"] in lengths
            and r["method"] in methods and r["seed"] in want]
    groups = grouped(keep)
    done = {g for g, rs in groups.items() if {r["seed"] for r in rs} == want}
    return [r for g in sorted(done, key=str) for r in groups[g]]


def grouped(records) -> dict[tuple, list[dict]]:
    """{(task, length, method): its records by seed}."""
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault((r["task"], r["length"], r["method"]), []).append(r)
    return {g: sorted(rs, key=lambda r: r["seed"]) for g, rs in out.items()}


@gin.configurable
def accuracy(name: str, model=gin.REQUIRED, checkpoint: str = gin.REQUIRED,
             tasks=("niah", "mrcr"), lengths=(1024, 2048), examples: int = 16,
             methods=("dense", "resident", "hisparse", "leansparse_C64", "leansparse_C128",
                      "leansparse_C2048", "leansparse_C4096", "direct_pq"),
             num_slots: int = 8, prefill_chunk: int = 1024, hot_cache_rows: int = 64,
             page_size: int = 64, miss_filter_offset: float | None = 1.0,
             calibration_tokens: int = 4096, implementation: str | None = "xla",
             host_pages: int | None = None, seed_offset: int = 0, recall: bool = True,
             compilation_cache: str | None = None, resume: bool = False,
             max_seconds: float | None = None):
    """Runs every method on the same held-out examples of every (task, length) cell.
    host_pages: CacheConfig.host_pages of the paged methods (None = enough for every slot).
    seed_offset: the first example seed (evaluation_seeds); another offset, a fresh example set.
    recall: also run the teacher-forced pass that measures indexer recall (doubles decoding).
    compilation_cache: a directory for JAX's persistent compilation cache (enable_cache; the
    environment variable JAX_COMPILATION_CACHE_DIR does the same): a later run with the same
    shapes loads its compiled steps instead of compiling them (on a GPU, most of a short
    study's time); carry the directory between machines to keep it.
    resume: keep the finished (task, length, method) groups of runs/<name>/results.json (an
    earlier run with the same settings, ``resumed_records``) and run only the others.
    max_seconds: a time budget from the start of this call; no batch or method starts after
    it (results.json then says complete=False; rerun with resume=True to finish).
    Examples run num_slots at a time: every method's engine is compiled once (at max(lengths))
    and reused by every batch, length and task, so fewer slots compile no faster and only add
    batches. Cells run task by task (every length of the first task, then the next), and
    results.json is rewritten after every method of every batch, so a run cut short keeps
    every finished group."""
    began = time.perf_counter()
    if compilation_cache is not None:  # before anything compiles
        enable_cache(v.resolve_path("accuracy.compilation_cache", compilation_cache, None))
    cfg, specs, path = check_settings(model, checkpoint, tasks, lengths, examples, methods,
                                      num_slots, prefill_chunk, hot_cache_rows, page_size,
                                      miss_filter_offset, calibration_tokens, implementation,
                                      host_pages)
    v.integer("accuracy.seed_offset", seed_offset, lo=0)
    measure_recall = v.flag("accuracy.recall", recall)
    v.flag("accuracy.resume", resume)
    v.number("accuracy.max_seconds", max_seconds, lo=0.0, none_ok=True)
    try:
        seeds = evaluation_seeds(seed_offset, examples)
    except ValueError as err:
        raise v.ConfigError(str(err)) from err
    settings = study_settings(cfg, checkpoint, path, num_slots, prefill_chunk, hot_cache_rows,
                              page_size, miss_filter_offset, calibration_tokens,
                              implementation, host_pages, measure_recall)
    cells = [(t, n) for t in tasks for n in lengths]  # the table: task by task
    records = (resumed_records(run_dir(name) / "results.json", settings, tasks, lengths,
                               methods, seeds) if resume else [])
    finished = set(grouped(records))
    if records:
        print(f"accuracy: resumed {len(finished)} finished (task, length, method) groups of "
              f"{run_dir(name) / 'results.json'}")
    todo = {c: [s for s in specs if c + (s.name,) not in finished] for c in cells}
    params = v.load_checkpoint("accuracy.checkpoint", path, cfg)
    needed = {s.name for c in cells for s in todo[c]}
    engines = {}
    if needed:
        engines = build_engines(params, cfg, [s for s in specs if s.name in needed], num_slots,
                                prefill_chunk, hot_cache_rows, page_size, calibration_tokens,
                                implementation, host_pages)
        compile_all(engines)

    def out_of_time() -> bool:
        return max_seconds is not None and time.perf_counter() - began > max_seconds

    def write(complete: bool):
        return save(name, cfg, checkpoint, examples, records, methods, cells, complete,
                    seeds=seeds, settings=settings)

    stopped = False
    bar = tqdm(total=sum(bool(todo[c]) for c in cells) * examples, desc="accuracy",
               unit="example")
    for task, length in cells:
        for lo in range(0, examples, num_slots) if todo[(task, length)] else ():
            if stopped or out_of_time():
                stopped = True
                break
            batch = [task_example(task, length, seed) for seed in seeds[lo:lo + num_slots]]
            t0 = time.perf_counter()
            if any(s.seed for s in todo[(task, length)]):  # the same prefill, keeping the
                prefilled, finals = zip(*[prefill_with_selections(  # final selections
                    params, cfg, ex.prompt, prefill_chunk) for ex in batch])
            else:
                prefilled, finals = [prefill(params, cfg, ex.prompt, prefill_chunk)
                                     for ex in batch], None
            jax.block_until_ready(prefilled)
            timing = {"prefill": f"{time.perf_counter() - t0:.1f}"}
            for s in todo[(task, length)]:
                if out_of_time():
                    stopped = True
                    break
                t0, parts = time.perf_counter(), {}
                records += evaluate(s, engines.get(s.name), params, cfg, task, length,
                                    seeds[lo:lo + len(batch)], batch, prefilled, finals,
                                    measure_recall, records, parts)
                timing[s.name] = f"{time.perf_counter() - t0:.1f}" + (
                    " ({})".format(", ".join(f"{k} {t:.1f}" for k, t in parts.items()))
                    if parts else "")
                write(complete=False)
            tqdm.write(f"accuracy: {task}@{length} seeds {seeds[lo]}.."
                       f"{seeds[lo] + len(batch) - 1} at {time.perf_counter() - began:.0f} s: "
                       + ", ".join(f"{k} {t} s" for k, t in timing.items()))
            bar.update(len(batch))
    bar.close()
    done = grouped(records)
    complete = all(c + (m,) in done and len(done[c + (m,)]) == examples
                   for c in cells for m in methods)
    summary, table = write(complete)
    plot(summary, methods, tasks, lengths, run_dir(name) / "accuracy.png")
    print(table)
    out = run_dir(name)
    if not complete:
        print(f"accuracy: stopped after {time.perf_counter() - began:.0f} s "
              f"(accuracy.max_seconds={max_seconds}); {len(done)} of "
              f"{len(cells) * len(methods)} (task, length, method) groups hold records; "
              "rerun with accuracy.resume=True to finish")
    print(f"wrote {out}/results.json, table.md and accuracy.png (complete={complete})")
    return summary


def build_engines(params, cfg, specs, num_slots, prefill_chunk, hot_cache_rows, page_size,
                  calibration_tokens, implementation, host_pages) -> dict:
    """One engine per method (dense has none), at max_len; leansparse's PQ codebooks
    calibrated once per subvector width on the held-out calibration prompt."""
    books = {}  # pq_subspace_dim -> codebooks
    for s in specs:
        if s.engine_method and method_storage(s.engine_method).keys_on_host:
            dim = s.lean.pq_subspace_dim
            if dim not in books:
                calib = task_example("niah", calibration_tokens, CALIBRATION_SEED)
                books[dim] = calibrate_codebooks(params, cfg, calib.prompt, subspace_dim=dim,
                                                 seed=0)
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
            params, books.get(s.lean.pq_subspace_dim) if s.lean else None)
    return engines


def evaluate(spec: Method, engine: Engine | None, params, cfg, task, length, seeds, batch,
             prefilled, finals, measure_recall: bool, records, timing: dict) -> list[dict]:
    """One method on one batch of a cell: its records (recall against resident's records of
    the same examples, already in ``records``, when measured)."""
    answers = [tokenizer.encode(ex.answer) for ex in batch]
    if engine is None:  # dense
        texts = [tokenizer.decode(dense_decode(params, cfg, c, last, len(ex.prompt), len(a) - 1))
                 for ex, (c, last), a in zip(batch, prefilled, answers)]
        sel = None
    else:
        fin = finals if spec.seed else None
        texts, _ = run_engine(engine, batch, prefilled, answers, False, fin, selections=False,
                              timing=timing)
        sel = None
        if measure_recall:
            _, sel = run_engine(engine, batch, prefilled, answers, True, fin)
    out = []
    for j, (ex, text) in enumerate(zip(batch, texts)):
        out.append(dict(task=task, length=length, seed=seeds[j], method=spec.name,
                        generated=text, answer=ex.answer, exact=score_exact(text, ex.answer),
                        similarity=score_similarity(text, ex.answer), recall=None,
                        recall_by_step=None, selections=sel[:, j] if sel is not None else None))
    if sel is not None:  # resident's own records hold recall 1
        reference = {r["seed"]: r for r in records + out if r["task"] == task
                     and r["length"] == length and r["method"] == "resident"}
        for r in out:
            ref = reference.get(r["seed"], {}).get("selections")
            if ref is not None:
                got = r["selections"]
                r["recall"] = selection_recall(got, ref)
                r["recall_by_step"] = [selection_recall(got[t], ref[t])
                                       for t in range(got.shape[0])]
    return out


def save(name, cfg, checkpoint, examples, records, methods, cells, complete: bool,
         seeds: range = range(0), settings: dict | None = None):
    """Writes the results of ``cells`` (after every method of every batch: a long run that
    stops early keeps what it measured, marked complete=False; a group cut short has n <
    examples, a group not run no cell record)."""
    summary = summarize(records, methods, cells)
    table = format_table(summary, methods, cells)
    out = run_dir(name)
    write_results(out, {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
                        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                        "examples_per_cell": examples, "complete": complete,
                        "evaluation_seeds": [seeds.start, seeds.stop],
                        "training_seeds": f">= {TRAIN_SEED_BASE}", "settings": settings,
                        "cells": cell_records(summary, methods, cells),
                        "mcnemar": pair_records(records, methods, cells),
                        "summary": summary, "table": table,
                        "records": [{k: x for k, x in r.items() if k != "selections"}
                                    for r in records]})
    (out / "table.md").write_text(table + "\n")
    return summary, table


def cell_records(summary, methods, cells) -> list[dict]:
    """One record per (task, length, method) that holds examples: exact, n, ci_low, ci_high,
    similarity, recall; beside resident also diff_vs_resident (exact - resident's on the same
    examples) with its paired 95% interval."""
    out = []
    for t, n in cells:
        for m in methods:
            c = summary[f"{t}@{n}"][m]
            if not c["n"]:
                continue
            rec = {"task": t, "length": n, "method": m,
                   **{k: c[k] for k in ("exact", "n", "ci_low", "ci_high", "similarity",
                                        "recall")}}
            if "diff_vs_resident" in c:
                d = c["diff_vs_resident"]
                rec.update(diff_vs_resident=d["diff"], diff_low=d["diff_low"],
                           diff_high=d["diff_high"])
            out.append(rec)
    return out


def paired(a: list[dict], b: list[dict]) -> tuple[list[float], list[float]]:
    """The exact-match outcomes of two groups' records on the examples both hold, by seed."""
    right = {r["seed"]: r["exact"] for r in b}
    common = [r for r in a if r["seed"] in right]
    return [r["exact"] for r in common], [right[r["seed"]] for r in common]


def pair_records(records, methods, cells) -> list[dict]:
    """One record per (task, length, method a, method b), a before b in ``methods``, both
    holding examples: the exact McNemar test of their outcomes on the same examples (a_only: a
    right and b wrong; n: the examples both hold) and the difference b - a with its paired
    95% interval (diff, diff_low, diff_high)."""
    groups, out = grouped(records), []
    for t, n in cells:
        for i, a in enumerate(methods):
            for b in methods[i + 1:]:
                x, y = paired(groups.get((t, n, a), []), groups.get((t, n, b), []))
                if x:
                    out.append({"task": t, "length": n, "a": a, "b": b, "n": len(x),
                                **mcnemar(x, y), **paired_difference(x, y)})
    return out


def summarize(records, methods, cells) -> dict:
    """Per cell and method: exact-match accuracy with its Wilson 95% interval, similarity,
    recall (n = 0: not run); McNemar and the paired difference (method - reference, Newcombe's
    interval) vs resident (and vs dense) per cell."""
    groups, out = grouped(records), {}
    for task, length in cells:
        mine = {m: groups.get((task, length, m), []) for m in methods}
        cell = {}
        for m, rs in mine.items():
            rec = [r["recall"] for r in rs if r["recall"] is not None]
            hits = int(sum(r["exact"] for r in rs))
            lo, hi = wilson(hits, len(rs))
            cell[m] = {"exact": hits / max(len(rs), 1), "ci_low": lo, "ci_high": hi,
                       "similarity": float(np.mean([r["similarity"] for r in rs]))
                       if rs else None,
                       "recall": float(np.mean(rec)) if rec else None, "n": len(rs)}
            for ref in ("resident", "dense"):
                if ref in mine and m != ref and rs and mine[ref]:
                    x, y = paired(rs, mine[ref])
                    cell[m][f"mcnemar_vs_{ref}"] = mcnemar(x, y)
                    cell[m][f"diff_vs_{ref}"] = paired_difference(y, x)
        out[f"{task}@{length}"] = cell
    return out


def _label(task: str, length: int) -> str:
    """A table column's name: "niah 8K" (or "niah 1000" off the 1024 grid)."""
    return f"{task} {length // 1024}K" if length % 1024 == 0 else f"{task} {length}"


def format_table(summary, methods, cells) -> str:
    """Markdown: one row per method, one column per cell: exact % (recall); "-" not run."""
    head = "| method | " + " | ".join(_label(t, n) for t, n in cells) + " |"
    lines = [head, "|" + "---|" * (len(cells) + 1)]
    for m in methods:
        row = []
        for t, n in cells:
            c = summary[f"{t}@{n}"][m]
            if not c["n"]:
                row.append("-")
                continue
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
                 "0.05 vs resident; - = not run.")
    diffs = format_differences(summary, methods, cells)
    return "\n".join(lines) + ("\n\n" + diffs if diffs else "")


def format_differences(summary, methods, cells) -> str:
    """Markdown: per method and cell, exact match minus resident's on the same examples, in
    points, with Newcombe's paired 95% interval ("" when no cell has both)."""
    rows = []
    for m in methods:
        diffs = [summary[f"{t}@{n}"][m].get("diff_vs_resident") for t, n in cells]
        if m != "resident" and any(diffs):
            rows.append(f"| {m} - resident | " + " | ".join(
                "-" if d is None else f"{100 * d['diff']:+.1f} [{100 * d['diff_low']:+.1f}, "
                f"{100 * d['diff_high']:+.1f}]" for d in diffs) + " |")
    if not rows:
        return ""
    head = "| difference | " + " | ".join(_label(t, n) for t, n in cells) + " |"
    return "\n".join([head, "|" + "---|" * (len(cells) + 1), *rows, "",
                      "Cells: exact match minus resident's on the same examples, points "
                      "[Newcombe's paired 95% interval]."])


def plot(summary, methods, tasks, lengths, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, m in enumerate(methods):
            dodge = 2 ** (0.05 * (i - (len(methods) - 1) / 2))  # methods side by side
            ran = [n for n in lengths if summary[f"{task}@{n}"][m]["n"]]  # cells not run: none
            cs = [summary[f"{task}@{n}"][m] for n in ran]
            if not cs:
                continue
            ys = np.array([100 * c["exact"] for c in cs])
            err = np.array([[y - 100 * c["ci_low"] for y, c in zip(ys, cs)],
                            [100 * c["ci_high"] - y for y, c in zip(ys, cs)]])
            err = np.maximum(err, 0.0)  # rounding: Wilson's bound at 0 or n can sit 1 ulp in
            ax.errorbar([n * dodge for n in ran], ys, yerr=err, fmt="o-", capsize=3,
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


# Settings that may differ between runs merged into one table: the engine's max_len follows
# the longest length of a run (its derived binding) and changes no method's outputs.
MERGEABLE = (("model", "max_len"),)


def _comparable(settings: dict) -> dict:
    out = json.loads(json.dumps(settings))
    if isinstance(out.get("model"), dict):  # fields added since a run count at their defaults
        out["model"] = fill_added_fields(
            out["model"], json.loads(json.dumps(dataclasses.asdict(ModelConfig()))), ModelConfig)
    for outer, inner in MERGEABLE:
        out.get(outer, {}).pop(inner, None)
    return out


def _provenance(source: str, run: dict) -> list[dict]:
    """Where a run's records came from: the run itself, or the runs an earlier merge names."""
    if "merged_from" in run:
        return [{"seeds": run["evaluation_seeds"], **entry, "via": source}
                for entry in run["merged_from"]]
    return [{"source": source, "lengths": sorted({g[1] for g in grouped(run["records"])}),
             "seeds": run["evaluation_seeds"],
             "max_len": run["settings"]["model"].get("max_len")}]


def _union_range(ranges: list[list[int]], sources: list[str]) -> list[int]:
    """[start, stop) covering seed ranges that overlap or touch; ValueError at a gap."""
    spans = sorted(zip(ranges, sources))
    start, stop = spans[0][0]
    for (lo, hi), src in spans[1:]:
        if lo > stop:
            raise ValueError(f"merge_results: seeds {lo}..{hi - 1} of {src} leave a gap after "
                             f"{stop - 1}: evaluation seed ranges must form one range")
        stop = max(stop, hi)
    return [start, stop]


def merge_results(runs: list[dict], sources: list[str] | None = None) -> dict:
    """One study from several runs of it (e.g. 1K-8K in one call, 16K in another, or more
    examples of a cell from the next seed range): ``runs`` are results.json dicts with the
    same settings apart from ``MERGEABLE`` (same checkpoint digest, slots, caches, device ...)
    whose evaluation seed ranges together form one contiguous range, and no example (task,
    length, method, seed) in two of them. Returns the merged results dict (cells, McNemar
    pairs, summary and table recomputed from the union of the records, pairs matched by
    seed; ``evaluation_seeds`` the union range, ``examples_per_cell`` its size, a cell's
    ``n`` what it holds; ``merged_from`` names each source with its lengths, seeds and
    max_len). Raises ValueError otherwise."""
    if not runs:
        raise ValueError("merge_results: no runs")
    sources = sources or [f"run {i}" for i in range(len(runs))]
    first = runs[0]
    ours, records, owner = _comparable(first["settings"]), [], {}
    for src, run in zip(sources, runs):
        theirs = _comparable(run["settings"])
        if theirs != ours:
            differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise ValueError(f"merge_results: {src} has other settings than {sources[0]} "
                             f"({', '.join(differ)})")
        for group, rs in grouped(run["records"]).items():
            for r in rs:
                if (*group, r["seed"]) in owner:
                    raise ValueError(f"merge_results: group {group} holds seed {r['seed']} in "
                                     f"{owner[(*group, r['seed'])]} and {src}")
                owner[(*group, r["seed"])] = src
        records += run["records"]
    seeds = _union_range([run["evaluation_seeds"] for run in runs], sources)
    groups = {key[:3] for key in owner}  # (task, length, method)
    tasks = [t for t in TASKS if any(g[0] == t for g in groups)]
    lengths = sorted({g[1] for g in groups})
    methods = list(dict.fromkeys(c["method"] for run in runs for c in run["cells"]))
    cells = [(t, n) for t in tasks for n in lengths]
    summary = summarize(records, methods, cells)
    table = format_table(summary, methods, cells)
    complete = all(r["complete"] for r in runs)
    return {**{k: first[k] for k in ("model", "checkpoint", "device", "jax",
                                      "training_seeds", "settings")},
            "examples_per_cell": seeds[1] - seeds[0], "evaluation_seeds": seeds,
            "complete": complete,
            "merged_from": [entry for s, r in zip(sources, runs) for entry in _provenance(s, r)],
            "cells": cell_records(summary, methods, cells),
            "mcnemar": pair_records(records, methods, cells), "summary": summary,
            "table": table, "records": records}


def write_merged(paths: list[str], out: str) -> dict:
    """``merge_results`` of the results.json files at ``paths`` written to ``out``
    (results.json, table.md, accuracy.png)."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    merged = merge_results(runs, [str(p) for p in paths])
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(results_json(merged))
    (out_dir / "table.md").write_text(merged["table"] + "\n")
    tasks = sorted({c["task"] for c in merged["cells"]}, key=TASKS.index)
    lengths = sorted({c["length"] for c in merged["cells"]})
    methods = list(dict.fromkeys(c["method"] for c in merged["cells"]))
    plot(merged["summary"], methods, tasks, lengths, out_dir / "accuracy.png")
    return merged
