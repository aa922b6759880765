"""Multi-turn replay: LeanSparse vs the ECHO-style baseline vs HiSparse under one scheduler
(LeanSparse section 6.2, Figure 10).

Gin header -- must be set: run.experiment = @replay, run.name, replay.model.
Run: lsparse run configs/experiments/replay_smoke.gin (CPU) or replay.gin (GPU).
Writes runs/<name>/{config.gin, results.json, replay_cdf.png}; results.json is rewritten
after every method (a cut run keeps the methods that finished; a rerun skips them).

Workload (``serving.workloads.MultiTurn``): the paper replays Open-SWE traces (128 sessions,
20-call windows, Poisson session arrivals at 120/min, recorded tool waits); those traces are
not available offline, so sessions come from the documented synthetic generator: each call's
prompt is the previous prompt + its response + a new turn of random tokens, after an
exponential tool wait. Turn 0 is each session's warmup prefill (outside the measured
window, as in the paper; ``warmup_first``: all of them before the window opens); TTFT and
TPOT cover calls of turn >= 2 (the continuations after each session's first measured call;
``ttft_measured``: TTFT over turns >= 1), session time spans the first measured call's
arrival to the last call's finish, throughput = output tokens of turns >= 1 over that span.

Serving: the scheduler (whole-prompt admission, or with ``prefill_token_budget`` first calls
prefilled in chunks beside the decode steps, as the paper's mixed prefill-decode batches; an
admission that does not fit waits) with ``num_slots`` active requests at most and a device
byte budget (``prefill_memory``: an admission also needs its prefill's transient bytes free,
two layer buffers for LeanSparse's layer-streamed prefill, every layer's state for the others:
the paper's TTFT mechanism); with ``prefix_reuse`` a session's next call reuses its
host-resident prefix (``Engine.detach`` / ``admit(prefix=)``), else it prefills the whole
prompt again. Per method: ``leansparse`` streams prefill layer by
layer (``streamed_prefill``); ``echo`` holds each prefill's whole history in its shared GPU KV
pool of ``echo_pool_rows`` entries per CSA layer (waits when it is full) and a buffer of
``hot_cache_rows['echo']`` per request; ``hisparse`` keeps its keys on the GPU and a hot
cache. Random weights (unless a checkpoint is given): each method's record carries the
measured step-to-step selection reuse.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import gin
import jax
import numpy as np
from tqdm.auto import tqdm

from experiments.common import cdf_plot, fit_max_len, results_json, run_dir, write_results
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_storage,
)
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params
from lsparse_jax.model.presets import preset
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.metrics import percentiles, throughput
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.scheduler import Clock, Scheduler
from lsparse_jax.serving.workloads import MultiTurn, RepeatInputs, session_records
from lsparse_jax.training import load_params

PANELS = (("ttft_s", "TTFT (s)", 1.0), ("tpot_s", "TPOT (ms)", 1e3),
          ("session_s", "session completion (s)", 1.0))


def replay_summary(records: list[dict]) -> dict:
    """The paper's replay statistics of one method's request records (see the module doc)."""
    cont = [r for r in records if r["turn"] >= 2]
    measured = [r for r in records if r["turn"] >= 1]
    sessions = session_records(records, from_turn=1)
    out = {"calls": len(records), "continuation_calls": len(cont),
           "sessions": len(sessions)}
    out |= percentiles([r["ttft_s"] for r in cont], "ttft")
    out |= percentiles([r["ttft_s"] for r in measured], "ttft_measured")  # turns >= 1
    out |= percentiles([r["tpot_s"] for r in cont], "tpot")
    out |= percentiles([s["session_s"] for s in sessions], "session")
    tokens, span, rate = throughput(measured)
    return out | {"output_tokens": tokens, "span_s": span, "throughput_tok_s": rate}


def _engine(cfg, params, method, slots, chunk, hot_cache_rows, page_size, echo_pool_rows,
            lean, implementation, seed, host_pages=None):
    storage = method_storage(method)
    if storage.kv_on_host and method not in hot_cache_rows:
        raise ValueError(f"replay.hot_cache_rows has no entry for {method!r}")
    cache = CacheConfig(slots, chunk, hot_cache_rows.get(method) if storage.kv_on_host
                        else None, page_size, host_pages=host_pages,
                        streamed_prefill=method == "leansparse",
                        shared_pool_rows=echo_pool_rows if method == "echo" else None)
    config = EngineConfig(model=cfg, method=method, cache=cache, leansparse=lean,
                          sampling=SamplingConfig(0.0, seed), implementation=implementation)
    books = None
    if storage.keys_on_host:  # PQ codebooks from tokens the run never serves
        calib = np.random.default_rng(seed + 1000).integers(0, min(cfg.vocab_size, 256),
                                                            4 * chunk)
        books = calibrate_codebooks(params, cfg, calib, subspace_dim=lean.pq_subspace_dim,
                                    seed=seed)
    return config, books


@gin.configurable
def replay(name: str, model=gin.REQUIRED, checkpoint: str | None = None,
           methods=("leansparse", "echo", "hisparse"), sessions: int = 8, calls: int = 4,
           first_prompt_tokens=(256, 512), turn_tokens=(32, 64), output_tokens=(8, 16),
           session_rate: float = 2.0, tool_wait_s: float = 0.5, num_slots: int = 4,
           device_budget_bytes: int | None = None, prefill_chunk: int = 256,
           hot_cache_rows=None, page_size: int = 16, echo_pool_rows: int = 4096,
           prefix_reuse: bool = True, prefill_memory: bool = False,
           prefill_token_budget: int | None = None, leansparse=None,
           implementation: str | None = "xla",
           step_s: float | None = None, prefill_token_s: float = 0.0, seed: int = 0,
           warmup_first: bool = False, memory_model: str | None = None,
           mixed: bool = False, input_repeat: float | None = None):
    """Replays the same synthetic sessions on each method; returns {method: summary}.
    hot_cache_rows: {method: B} (the paper: LeanSparse 2048, ECHO 512, HiSparse 4096).
    warmup_first: every session's warmup call first, the measured window after them
    (``MultiTurn.warmup_first``). memory_model: a preset name; the budget counts the served
    model with that preset's layer pattern (e.g. 'v4_flash': the 43 layers whose 4-layer slice
    runs; ``Scheduler(memory_model=)``); None: the served model. mixed: a prefill chunk of
    each iteration inside the decode step (``Scheduler(mixed=True)``; a layer-streamed
    prefill, LeanSparse's, raises ValueError: run such methods without it). input_repeat:
    teacher-forced decode inputs from ``RepeatInputs(input_repeat)`` (``Scheduler(inputs=)``: a
    step-to-step selection reuse like the trained model's where random weights give ~0.02;
    each call's response, and so the next call's prompt, is then the inputs it was fed);
    None: each request decodes its own samples."""
    hot = dict(hot_cache_rows or {"leansparse": 2048, "echo": 512, "hisparse": 4096})
    lean = leansparse or LeanSparseConfig()
    load = dict(sessions=sessions, calls=calls, first_prompt_tokens=tuple(first_prompt_tokens),
                turn_tokens=tuple(turn_tokens), output_tokens=tuple(output_tokens),
                session_rate=session_rate, tool_wait_s=tool_wait_s, seed=seed,
                warmup_first=warmup_first)
    # the longest session: every call at its longest
    longest = (first_prompt_tokens[1] + (calls - 1) * (output_tokens[1] + turn_tokens[1])
               + output_tokens[1])
    cfg = fit_max_len(model, longest + 1)
    params = load_params(checkpoint, cfg) if checkpoint else init_params(cfg, seed)
    out = run_dir(name)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    per_method = results.get("methods", {})
    for method in methods:
        if method in per_method:
            continue
        # host pages for every session's held prefix beside the running calls, at max_len
        per_slot = -(-(cfg.max_len // cfg.csa_ratio) // page_size)
        config, books = _engine(cfg, params, method, num_slots, prefill_chunk, hot, page_size,
                                echo_pool_rows, lean, implementation, seed,
                                host_pages=(num_slots + sessions) * per_slot)
        _warm(Engine(config, params, books), first_prompt_tokens[0], turn_tokens[0],
              prefix_reuse, chunked=prefill_token_budget is not None)
        engine = Engine(config, params, books)
        engine.warmup()
        memory = (None if memory_model is None else dataclasses.replace(
            config, model=dataclasses.replace(
                cfg, layer_pattern=preset(memory_model).layer_pattern)))
        work = MultiTurn(**load, vocab=min(cfg.vocab_size, 256), max_len=cfg.max_len)
        sched = Scheduler(engine, device_budget_bytes, Clock(step_s, prefill_token_s),
                          workload=work, prefix_reuse=prefix_reuse,
                          prefill_memory=prefill_memory, memory_model=memory,
                          prefill_token_budget=prefill_token_budget, mixed=mixed,
                          inputs=None if input_repeat is None else RepeatInputs(
                              input_repeat, cfg.vocab_size, seed))
        with tqdm(total=sessions * calls, desc=f"replay {method}", unit="call") as bar:
            sched.run(bar)
        records = sched.records()
        summary = replay_summary(records)
        metrics = engine.metrics()
        per_method[method] = {
            "summary": summary, "scheduler": sched.summary(), "records": records,
            "sessions": session_records(records, from_turn=1),
            "truncated_sessions": work.truncated,
            "reuse": metrics["selection"]["reuse_fraction"],
            "resolved_fraction": metrics["selection"]["resolved_fraction"],
            "engine": {k: v for k, v in metrics.items() if k != "selection"},
            "cache": dataclasses.asdict(config.cache)}
        _write(out, per_method, cfg, load, dict(
            checkpoint=checkpoint, num_slots=num_slots, device_budget_bytes=device_budget_bytes,
            prefill_chunk=prefill_chunk, echo_pool_rows=echo_pool_rows,
            prefix_reuse=prefix_reuse, prefill_memory=prefill_memory,
            prefill_token_budget=prefill_token_budget, mixed=mixed,
            input_repeat=input_repeat, memory_model=memory_model,
            memory_model_layers=None if memory is None else memory.model.num_layers,
            implementation=implementation,
            clock="measured wall time" if step_s is None else
            {"step_s": step_s, "prefill_token_s": prefill_token_s}))
        del engine, sched
    _table(per_method)
    return {m: v["summary"] for m, v in per_method.items()}


def _warm(engine: Engine, prompt_tokens: int, turn_tokens: int, prefix_reuse: bool,
          chunked: bool = False):
    """Compiles every step of a call's life (jit caches outlive the engine) so that the
    scheduler's clock never counts compilation: admission (chunked: from
    ``Engine.prefill_chunks``), a step, release; with prefix reuse also detach and an
    admission from the prefix."""
    engine.warmup()
    r = Request(np.zeros(prompt_tokens, np.int32), 2)
    last = None  # only the last chunk's result is kept (each holds a whole prefill state)
    for chunk, _ in (engine.prefill_chunks(r.prompt) if chunked else ()):
        last = chunk
    engine.admit(r, prefilled=last)
    engine.step()
    if not prefix_reuse:
        engine.release(0)
        return
    prefix = engine.detach(0)
    nxt = np.concatenate([r.prompt, np.asarray(r.tokens, np.int32),
                          np.zeros(turn_tokens, np.int32)])
    engine.admit(Request(nxt, 2), prefix=prefix)
    engine.step()
    engine.release(0)


def _write(out, per_method, cfg, load, settings):
    write_results(out, {
        "methods": per_method, "model": dataclasses.asdict(cfg), "workload": load,
        "settings": settings, "device": jax.devices()[0].device_kind,
        "note": "synthetic sessions (serving.workloads.MultiTurn): the Open-SWE traces are "
                "not available offline; random weights unless a checkpoint is given"})
    plot(per_method, out / "replay_cdf.png")


def plot(per_method: dict, path) -> None:
    """TTFT / TPOT / session-time CDFs of each method's records (the paper's Figure 10)."""
    series = {}
    for m, v in per_method.items():
        cont = [r for r in v["records"] if r["turn"] >= 2]
        series[f"{m} (reuse {v['reuse']:.2f})"] = {
            "ttft_s": [r["ttft_s"] for r in cont], "tpot_s": [r["tpot_s"] for r in cont],
            "session_s": [s["session_s"] for s in v["sessions"]]}
    cdf_plot(series, PANELS, path, marks=True)


def merge_runs(paths: list[str], out_dir: str) -> dict:
    """One results.json of several replay runs of the same model, workload and settings (e.g.
    methods run in separate device calls): their methods side by side, each source recorded
    in ``merged_from``, summaries recomputed from the records; a method in two runs or any
    other difference is an error. Run:
    ``python -c "from experiments.replay import merge_runs; merge_runs([A, B], OUT)"``."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    merged = {k: v for k, v in runs[0].items() if k != "methods"} | {"methods": {}}
    merged["merged_from"] = []
    for path, run in zip(paths, runs):
        for key in ("model", "workload", "settings", "device"):
            if run[key] != runs[0][key]:
                raise ValueError(f"merge_runs: {path} has another {key} than {paths[0]}")
        for method, record in run["methods"].items():
            if method in merged["methods"]:
                raise ValueError(f"merge_runs: method {method!r} is in two runs ({path})")
            merged["methods"][method] = record | {"summary": replay_summary(record["records"])}
        merged["merged_from"].append({"source": str(path), "methods": list(run["methods"])})
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(results_json(merged))
    config = pathlib.Path(paths[0]).with_name("config.gin")  # the same settings in every run
    if config.exists():
        (out / "config.gin").write_text(merged_config(config.read_text(),
                                                      list(merged["methods"]), paths))
    plot(merged["methods"], out / "replay_cdf.png")
    _table(merged["methods"])
    return merged


def merged_config(text: str, methods: list[str], paths) -> str:
    """The first run's config.gin with ``replay.methods`` naming every merged method (the runs
    differ in nothing else: ``merge_runs`` checks it) and a header naming the sources."""
    lines = [f"replay.methods = {tuple(methods)!r}" if ln.startswith("replay.methods =")
             else ln for ln in text.splitlines()]
    head = [f"# merged by experiments.replay.merge_runs from {len(paths)} runs:"]
    head += [f"#   {p}" for p in paths]
    return "\n".join(head + lines) + "\n"


def _table(per_method):
    print(f"{'method':<11} {'TTFT p50 s':>10} {'p95 s':>8} {'TPOT p50 ms':>11} "
          f"{'session p50 s':>13} {'tok/s':>8} {'reuse':>6} waits")
    for m, v in per_method.items():
        s, sched = v["summary"], v["scheduler"]
        fmt = lambda x, scale=1.0: "-" if x is None else f"{x * scale:.3g}"  # noqa: E731
        print(f"{m:<11} {fmt(s['ttft_p50_s']):>10} {fmt(s['ttft_p95_s']):>8} "
              f"{fmt(s['tpot_p50_s'], 1e3):>11} {fmt(s['session_p50_s']):>13} "
              f"{fmt(s['throughput_tok_s']):>8} {v['reuse']:>6.3f} {sched['waits_by']}")
