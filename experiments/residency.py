"""Load-step study of Adaptive DHiSparse's optional residency vs HiSparse's fixed hot cache.

Gin header -- must be set: run.experiment, run.name, residency.model, residency.checkpoint
(None: random weights, seeded; e.g. the V4-shape load step of configs/experiments/loadstep.gin).
Run: lsparse run configs/experiments/residency.gin (or loadstep_smoke.gin, loadstep.gin)
Writes runs/<name>/{config.gin, results.json, residency.png}.

Requests (held-out NIAH prompts) arrive one every ``arrival_steps`` decode steps, each decodes
``decode_tokens`` tokens and leaves: the load ramps up, holds, and drains. ``hisparse`` and
``adaptive`` (and ``resident``, the reference) serve the same schedule; greedy tokens must be
identical (both are exact). Per step: active requests, the resolver's fractions of selected
rows (step 1: tail, resident or ready optional pages; step 2: hot cache; host copy), and
adaptive's optional pages in use; per method the step-to-step selection reuse. The summary
gives the fractions by number of active requests (the load step: at C = num_slots, the
paper's C8 row: 69.7% step 1, 30.3% step 2, 0.05% host on GLM-5.3). The paper's claim,
qualitatively: optional residency cuts host-fetched selections at low load, releases pages
under pressure (newcomers reclaim the oldest requests' pages), and repopulates them as
requests drain.
"""

from __future__ import annotations

import dataclasses

import gin
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import pyplot, run_dir, write_results
from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig, method_storage
from lsparse_jax.model import init_params
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.workloads import RepeatInputs
from lsparse_jax.training.data import task_example


def _engine(method, cfg, params, slots, chunk, hot_rows, page, optional, refill,
            host_pages=None, implementation="xla", shared_budget_bytes=None):
    storage = method_storage(method)
    return Engine(EngineConfig(
        model=cfg, method=method, sampling=SamplingConfig(0.0, 0),
        implementation=implementation,
        cache=CacheConfig(slots, chunk, hot_rows if storage.kv_on_host else None, page,
                          host_pages=host_pages if storage.kv_on_host else None,
                          optional_pages=optional if storage.lent_pages else None,
                          refill_pages=refill,
                          shared_budget_bytes=shared_budget_bytes if storage.lent_pages
                          else None)), params)


IMPLEMENTATIONS = ("xla", "triton", "jax_triton", "mosaic", None)


def check_settings(model, checkpoint, prompt_tokens, requests, arrival_steps, decode_tokens,
                   num_slots, prefill_chunk, hot_cache_rows, page_size, optional_pages,
                   refill_pages, host_pages, implementation, input_repeat=None):
    """Validates every setting and the checkpoint path before any work; returns (the model with
    max_len fitted, the checkpoint directory)."""
    if v.number("residency.input_repeat", input_repeat, lo=0.0, none_ok=True) is not None \
            and input_repeat > 1:
        v.fail("residency.input_repeat", input_repeat, "must be a number in [0, 1] or None")
    for setting, value in (("prompt_tokens", prompt_tokens), ("requests", requests),
                           ("arrival_steps", arrival_steps), ("decode_tokens", decode_tokens),
                           ("num_slots", num_slots), ("prefill_chunk", prefill_chunk),
                           ("page_size", page_size), ("optional_pages", optional_pages),
                           ("refill_pages", refill_pages)):
        v.integer(f"residency.{setting}", value)
    v.choice("residency.implementation", implementation, IMPLEMENTATIONS)
    tokens = prompt_tokens + decode_tokens + 1
    cfg = v.fit_model(model, tokens, "residency.prompt_tokens + decode_tokens + 1")
    v.integer("residency.hot_cache_rows", hot_cache_rows, lo=cfg.indexer.top_k)
    v.host_pages("residency.host_pages", host_pages, cfg, tokens, page_size,
                 min(num_slots, requests))
    if checkpoint is None:  # random weights
        return cfg, None
    return cfg, v.checkpoint_path("residency.checkpoint", checkpoint)


@gin.configurable
def residency(name: str, model=gin.REQUIRED, checkpoint: str | None = gin.REQUIRED,
              prompt_tokens: int = 2048, requests: int = 12, arrival_steps: int = 4,
              decode_tokens: int = 40, num_slots: int = 8, prefill_chunk: int = 1024,
              hot_cache_rows: int = 64, page_size: int = 16, optional_pages: int = 64,
              refill_pages: int = 4, host_pages: int | None = None,
              implementation: str | None = "xla", shared_budget_bytes: int | None = None,
              input_repeat: float | None = None, seed: int = 0):
    """Runs the schedule on resident, hisparse and adaptive; returns the per-step series.
    host_pages: CacheConfig.host_pages (None = enough for every slot). checkpoint None:
    random weights from ``seed``. shared_budget_bytes: adaptive's required state and lent
    pages share this budget (``CacheConfig.shared_budget_bytes``; None: separate pools); it
    must hold num_slots requests' required bytes (this schedule never waits), so it bounds
    only what is lent. input_repeat: teacher-forced decode inputs from
    ``RepeatInputs(input_repeat)`` (a tunable step-to-step selection reuse, as the capacity
    and replay studies' p; a newly admitted request repeats its own first token), the same
    inputs for every method; None: each slot feeds what it sampled. With it the methods'
    sampled tokens are compared step by step (the fed inputs alone would agree trivially)."""
    cfg, path = check_settings(model, checkpoint, prompt_tokens, requests, arrival_steps,
                               decode_tokens, num_slots, prefill_chunk, hot_cache_rows,
                               page_size, optional_pages, refill_pages, host_pages,
                               implementation, input_repeat)
    params = (init_params(cfg, seed) if path is None
              else v.load_checkpoint("residency.checkpoint", path, cfg))
    prompts = [task_example("niah", prompt_tokens, seed).prompt for seed in range(requests)]
    methods = ("resident", "hisparse", "adaptive")
    engines = {m: _engine(m, cfg, params, num_slots, prefill_chunk, hot_cache_rows, page_size,
                          optional_pages, refill_pages, host_pages, implementation,
                          shared_budget_bytes)
               for m in methods}
    for e in engines.values():
        e.warmup()
    series = {m: {"active": [], "host_fraction": [], "step1_fraction": [],
                  "step2_fraction": [], "optional_pages": []} for m in methods}
    slots = {m: {} for m in methods}  # request -> slot
    left = {}  # request -> tokens still to decode
    texts = {m: {} for m in methods}
    inputs = None if input_repeat is None else {
        m: RepeatInputs(float(input_repeat), cfg.vocab_size, seed) for m in methods}
    sampled = {m: [] for m in methods}  # per step: the active slots' sampled tokens
    step, admitted = 0, 0
    with tqdm(desc="residency", unit="step") as bar:
        while admitted < requests or left:
            fresh = {m: np.zeros(num_slots, bool) for m in methods}
            if admitted < requests and step % arrival_steps == 0 and len(left) < num_slots:
                for m, e in engines.items():
                    slots[m][admitted] = e.admit(prompts[admitted], decode_tokens + 1)
                    fresh[m][slots[m][admitted]] = True
                left[admitted] = decode_tokens
                admitted += 1
            for m, e in engines.items():
                feed = None if inputs is None else inputs[m](e.next_token, fresh=fresh[m])
                out = e.step(feed)
                sampled[m].append(np.asarray(out.tokens)[e.active])
                src = np.asarray(out.sources)[e.active].sum(axis=(0, 1))
                series[m]["active"].append(int(e.active.sum()))
                for key, i in (("step1_fraction", 0), ("step2_fraction", 1),
                               ("host_fraction", 2)):
                    series[m][key].append(float(src[i] / max(src.sum(), 1)))
                series[m]["optional_pages"].append(
                    e.metrics().get("optional_pages_in_use", 0))
            for r in list(left):
                left[r] -= 1
                if left[r] == 0:
                    for m, e in engines.items():
                        texts[m][r] = e.release(slots[m][r])
                    del left[r]
            step += 1
            bar.update(1)
    for m in ("hisparse", "adaptive"):
        if texts[m] != texts["resident"] or not all(
                np.array_equal(a, b) for a, b in zip(sampled[m], sampled["resident"],
                                                     strict=True)):
            raise AssertionError(f"residency: {m} generated different tokens than resident "
                                 "(exact methods must agree)")
    summary = {m: {"host_fraction_mean": float(np.mean(series[m]["host_fraction"])),
                   "host_fraction_by_load": _by_load(series[m]),
                   "resolver_by_load": _resolver_by_load(series[m]),
                   "reuse": engines[m].metrics()["selection"]["reuse_fraction"]}
               for m in methods}
    out = run_dir(name)
    write_results(out, {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
                        "weights": "random (seeded)" if path is None else "checkpoint",
                        "implementation": implementation, "steps": step,
                        "input_repeat": input_repeat,
                        "tokens_identical_to_resident": True, "summary": summary,
                        "series": series})
    plot(series, cfg, out / "residency.png")
    for m in ("hisparse", "adaptive"):
        full = summary[m]["resolver_by_load"].get(num_slots)
        print(f"{m}: mean host-copied fraction of selected rows "
              f"{summary[m]['host_fraction_mean']:.3f}; by active requests "
              f"{summary[m]['host_fraction_by_load']}; reuse {summary[m]['reuse']:.3f}; "
              f"resolver at C{num_slots}: {full}")
    print(f"wrote {out}/results.json and residency.png")
    return summary


def _by_load(s) -> dict:
    """Mean host-copied fraction per number of active requests."""
    active, frac = np.asarray(s["active"]), np.asarray(s["host_fraction"])
    return {int(a): round(float(frac[active == a].mean()), 4) for a in np.unique(active)}


def _resolver_by_load(s) -> dict:
    """Per number of active requests: the mean fractions of selected rows resolved in step 1
    (tail / resident / ready optional pages), step 2 (hot cache) and from the host."""
    active = np.asarray(s["active"])
    return {int(a): {k: round(float(np.asarray(s[f"{k}_fraction"])[active == a].mean()), 4)
                     for k in ("step1", "step2", "host")} for a in np.unique(active)}


def plot(series, cfg, path):
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for m in ("hisparse", "adaptive"):
        ax1.plot(series[m]["host_fraction"], label=m)
    ax1.set_ylabel("selected rows copied from host")
    ax1.legend()
    ax2.plot(series["adaptive"]["optional_pages"], label="adaptive: optional pages in use")
    ax2.plot(series["adaptive"]["active"], label="active requests")
    ax2.set_xlabel("decode step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
