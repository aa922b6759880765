"""Serving under load: Poisson arrivals through the scheduler, latency CDFs and throughput.

Gin header -- must be set: run.experiment, run.name, serve.model.
Run: lsparse run configs/experiments/serve_smoke.gin
Writes runs/<name>/{config.gin, results.json, latency_cdf.png}.

Requests with uniformly drawn prompt and output lengths (random token ids: with random weights
the text means nothing, the lengths and timings do; ``prompt_task="niah"`` draws held-out NIAH
prompts of those lengths instead, for a trained model and drafter) arrive as a Poisson process of
``arrival_rate`` per second from a seeded generator (or come from ``clients`` closed-loop
clients). The scheduler (lsparse_jax.serving.scheduler) admits them first come, first served
under ``num_slots`` and ``device_budget_bytes``, prefills each prompt (whole, or in chunks of a
per-iteration token budget beside the decode step), decodes the active set one step per
iteration and releases finished requests at once.
results.json: the aggregates
(``completed``, ``ttft_p50_s``, ``tpot_p50_s``, ``throughput_tok_s``, ``admission_waits``, ...),
per-request records, the per-iteration trace and the configuration.

Speculative serving: ``drafter_checkpoint`` (a trained drafter, configs/experiments/
train_drafter.gin) serves through ``SpecEngine`` (one verification of gamma drafts per active
request and iteration; its ring and staging bytes count in the budget). ``budget_fit=(method,
N)`` sets the device budget to exactly N requests of ``method`` served plainly at the run's
longest request (``memory.accounting.request_bytes``), so that runs of several methods share
one budget where memory caps admission (configs/experiments/serve_capped.gin).
"""

from __future__ import annotations

import dataclasses

import gin
import numpy as np
from tqdm.auto import tqdm

from experiments.common import cdf_plot, fit_max_len, run_dir, write_results
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_storage,
)
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.scheduler import Clock, Scheduler
from lsparse_jax.serving.workloads import ClosedLoop, OpenLoop, poisson_requests
from lsparse_jax.training import load_params
from lsparse_jax.training.data import task_example

PROMPT_TASKS = ("random", "niah")
NIAH_SEEDS = 5_000_000  # serve's NIAH prompts: seeds from here (no study uses this range)


def niah_prompts(requests: list[Request], seed: int) -> list[Request]:
    """The requests with held-out NIAH prompts of their lengths (seeds NIAH_SEEDS + seed *
    10**4 + i), arrivals and outputs unchanged."""
    return [dataclasses.replace(r, prompt=task_example(
        "niah", len(r.prompt), NIAH_SEEDS + seed * 10**4 + i).prompt)
        for i, r in enumerate(requests)]


@gin.configurable
def serve(name: str, model=gin.REQUIRED, checkpoint: str | None = None,
          method: str = "resident", requests: int = 24, arrival_rate: float = 10.0,
          prompt_tokens=(64, 256), max_new_tokens=(8, 32), num_slots: int = 4,
          device_budget_bytes: int | None = None, prefill_chunk: int = 64,
          prefill_token_budget: int | None = None,
          hot_cache_rows: int = 32, page_size: int = 16, host_pages: int | None = None,
          optional_pages: int = 32, step_s: float | None = None, prefill_token_s: float = 0.0,
          stop_strings=(), leansparse=None, clients: int | None = None,
          think_s: float = 0.0, echo_pool_rows: int = 4096, overlap: bool = False,
          seed: int = 0, drafter_checkpoint: str | None = None, prompt_task: str = "random",
          budget_fit: tuple | None = None, adaptive_shares_budget: bool = False,
          drafter_ring: str | None = None, mixed: bool = False):
    """Serves ``requests`` Poisson arrivals with ``method``; returns the summary.

    clients: a closed loop instead (``serving.workloads.ClosedLoop``): C clients at fixed
    lengths (prompt_tokens[1] in, max_new_tokens[1] out), each sending its next request
    ``think_s`` after its previous one finishes, requests // clients each (arrival_rate
    unused). echo_pool_rows: echo's shared GPU KV pool entries per CSA layer. overlap: each
    decode step launched before the previous one is read (``Scheduler(overlap=True)``).

    checkpoint: None serves random weights (seeded). prefill_token_budget: None prefills
    each prompt whole at admission (decode stalls); a value prefills that many prompt tokens
    per iteration (whole chunks) beside the decode step (Sarathi-style). step_s: None
    advances the scheduler's clock by measured wall time; a value makes it fixed (step_s per
    decode step, prefill_token_s per prompt token). hot_cache_rows, page_size, host_pages:
    the paged methods'; optional_pages: adaptive's; leansparse: a LeanSparseConfig.
    drafter_checkpoint: serve speculatively (module doc). prompt_task: "random" token ids or
    "niah" prompts (seeds from NIAH_SEEDS + seed * 10**4, one per request). budget_fit:
    (method, N) replaces device_budget_bytes by N requests' bytes of ``method`` (module
    doc). adaptive_shares_budget: adaptive's lent pages come out of the device budget too
    (``CacheConfig.shared_budget_bytes``; its required bytes count a drafter's ring and
    staging), instead of a separate pool of optional_pages. drafter_ring: None serves the
    checkpoint's ring; "kv" or "features" overrides ``DrafterConfig.ring`` (same weights).
    mixed: one prefill chunk of each iteration runs inside the decode step
    (``Scheduler(mixed=True)``; needs prefill_token_budget)."""
    if prompt_task not in PROMPT_TASKS:
        raise ValueError(f"serve.prompt_task={prompt_task!r} must be one of {PROMPT_TASKS}")
    if prompt_task == "niah" and clients is not None:
        raise ValueError("serve.prompt_task='niah': not supported with serve.clients")
    if budget_fit is not None and (not isinstance(budget_fit, (tuple, list))
                                   or len(budget_fit) != 2 or isinstance(budget_fit[1], bool)
                                   or not isinstance(budget_fit[1], int) or budget_fit[1] < 1):
        raise ValueError(f"serve.budget_fit={budget_fit!r} must be (method, N >= 1)")
    if drafter_ring is not None and drafter_checkpoint is None:
        raise ValueError("serve.drafter_ring: set only with serve.drafter_checkpoint")
    cfg = fit_max_len(model, prompt_tokens[1] + max_new_tokens[1])
    params = load_params(checkpoint, cfg) if checkpoint else init_params(cfg, seed)

    def engine_config(m: str, shared: int | None = None) -> EngineConfig:
        storage = method_storage(m)
        cache = CacheConfig(num_slots, prefill_chunk,
                            hot_cache_rows if storage.kv_on_host else None, page_size,
                            host_pages, optional_pages=optional_pages if storage.lent_pages
                            else None, shared_pool_rows=echo_pool_rows if m == "echo" else None,
                            shared_budget_bytes=shared)
        return EngineConfig(model=cfg, method=m, cache=cache, sampling=SamplingConfig(0.0, seed),
                            leansparse=leansparse or LeanSparseConfig())

    if budget_fit is not None:
        fit = request_bytes(engine_config(budget_fit[0]),
                            prompt_tokens[1] + max_new_tokens[1]).gpu_total
        device_budget_bytes = budget_fit[1] * fit
    shares = adaptive_shares_budget and method_storage(method).lent_pages
    if shares and device_budget_bytes is None:
        raise ValueError("serve.adaptive_shares_budget: needs device_budget_bytes or budget_fit")
    config = engine_config(method, device_budget_bytes if shares else None)
    cache, storage = config.cache, method_storage(method)
    codebooks = None
    if storage.keys_on_host:  # PQ codebooks from tokens the run never serves
        calib = np.random.default_rng(seed + 1000).integers(0, cfg.vocab_size, 1024)
        codebooks = calibrate_codebooks(params, cfg, calib,
                                        subspace_dim=config.leansparse.pq_subspace_dim,
                                        seed=seed)
    if drafter_checkpoint is None:
        make = lambda: Engine(config, params, codebooks)  # noqa: E731
    else:
        from lsparse_jax.serving.speculative import SpecEngine
        from lsparse_jax.training.drafter import load_drafter

        dparams, dcfg = load_drafter(drafter_checkpoint)
        if drafter_ring is not None:
            dcfg = dataclasses.replace(dcfg, ring=drafter_ring)  # ValueError if not a ring
        drafter = (dparams, dcfg)
        make = lambda: SpecEngine(config, params, drafter, codebooks)  # noqa: E731
    warm = make()  # compiles every step of a request's life
    warm.warmup()  # (jit caches outlive the engine), so the clock never counts compilation
    warm.admit(Request(np.zeros(prompt_tokens[0], np.int32), 2))
    warm.step()
    warm.release(0)
    del warm
    engine = make()
    engine.warmup()
    if clients is None:
        arrivals = poisson_requests(requests, arrival_rate, prompt_tokens, max_new_tokens,
                                    cfg.vocab_size, seed, stop_strings)
        if prompt_task == "niah":
            arrivals = niah_prompts(arrivals, seed)
        work = OpenLoop(arrivals)
    else:
        if stop_strings:
            raise ValueError("serve.stop_strings: not supported with serve.clients")
        work = ClosedLoop(clients, prompt_tokens[1], max_new_tokens[1], requests // clients,
                          cfg.vocab_size, think_s, seed)
        requests = clients * (requests // clients)
    sched = Scheduler(engine, device_budget_bytes, Clock(step_s, prefill_token_s),
                      prefill_token_budget, workload=work, overlap=overlap, mixed=mixed)
    label = method + ("+drafter" if drafter_checkpoint else "")
    with tqdm(total=requests, desc=f"serve {label}", unit="req") as bar:
        sched.run(bar)
    summary = sched.summary()
    out = run_dir(name)
    write_results(out, summary | {
        "method": method, "speculative": drafter_checkpoint is not None,
        "requests": sched.records(), "trace": sched.trace, "engine": engine.metrics(),
        "config": {"model": dataclasses.asdict(cfg), "checkpoint": checkpoint,
                   "drafter_checkpoint": drafter_checkpoint,
                   "drafter_ring": None if drafter_checkpoint is None else drafter[1].ring,
                   "prompt_task": prompt_task,
                   "budget_fit": None if budget_fit is None else list(budget_fit),
                   "adaptive_shares_budget": bool(shares),
                   "cache": dataclasses.asdict(cache), "requests": requests,
                   "arrival_rate": arrival_rate, "prompt_tokens": list(prompt_tokens),
                   "clients": clients, "think_s": think_s,
                   "max_new_tokens": list(max_new_tokens), "stop_strings": list(stop_strings),
                   "device_budget_bytes": device_budget_bytes,
                   "prefill_token_budget": prefill_token_budget, "overlap": overlap,
                   "mixed": mixed,
                   "clock": "measured wall time" if step_s is None else
                   {"step_s": step_s, "prefill_token_s": prefill_token_s}, "seed": seed},
        "note": ("whole-prompt prefill (an admission stalls decoding)"
                 if prefill_token_budget is None else "chunked prefill beside decode steps "
                 "(separate calls in one iteration, not one fused batch)")
                + "; random weights unless a checkpoint is given"})
    plot(sched.records(), label, out / "latency_cdf.png")
    print(f"{label}: {summary['completed']} requests, TTFT p50 {summary['ttft_p50_s']:.3f} s "
          f"p95 {summary['ttft_p95_s']:.3f} s, TPOT p50 {1e3 * summary['tpot_p50_s']:.1f} ms, "
          f"{summary['throughput_tok_s']:.1f} tok/s, {summary['admission_waits']} admission "
          f"waits {summary['waits_by']}")
    print(f"wrote {out}/results.json and latency_cdf.png")
    return summary


def plot(records: list[dict], label: str, path):
    """Empirical CDFs of TTFT, TPOT and end-to-end latency (one panel each)."""
    values = {key: [r[key] for r in records] for key in ("ttft_s", "tpot_s", "e2e_s")}
    cdf_plot({label: values}, (("ttft_s", "TTFT (s)", 1.0), ("tpot_s", "TPOT (ms)", 1e3),
                               ("e2e_s", "end-to-end (s)", 1.0)), path)
