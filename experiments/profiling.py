"""GPU kernel time from a ``jax.profiler`` trace: which kernels one call of a jitted program
launched, their summed time (busy) and the interval they covered (span). Busy close to span
says the kernels themselves take the time; busy far below span says gaps (launch latency,
host work, waits) do. Used by ``kernel_compare(profile=True)`` and the GPU benchmark scripts
(``benchmarks/traces.py``)."""

from __future__ import annotations

import gzip
import json
import pathlib
import tempfile

import jax


def read_trace(path) -> tuple[list[dict], set]:
    """A Perfetto / chrome trace file (.json or .json.gz): (its events, the pids of its GPU
    processes)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    ev = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    return ev, gpu


def gpu_events(trace_dir: pathlib.Path) -> list[tuple[str, float, float]]:
    """(name, start_us, dur_us) of the GPU events of the newest Perfetto trace under
    ``trace_dir`` (``jax.profiler.trace(..., create_perfetto_trace=True)``), in start order;
    [] when there is none (e.g. on a CPU, whose trace has no GPU process)."""
    found = sorted(pathlib.Path(trace_dir).rglob("*trace.json.gz"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        return []
    ev, gpu = read_trace(found[-1])
    return sorted(((e["name"], e["ts"], e.get("dur", 0)) for e in ev
                   if e.get("ph") == "X" and e.get("pid") in gpu), key=lambda e: e[1])


def per_call(events, calls: int) -> dict:
    """Per call of a program that made ``calls`` calls, from ``gpu_events`` (memsets left out):
    kernels, busy_us (summed kernel time), span_us (first start to last end) and by_name (busy
    us per kernel name, first 60 characters); {} when there are no events."""
    ev = [e for e in events if "memset" not in e[0].lower()]
    if not ev:
        return {}
    by_name = {}
    for name, _, dur in ev:
        by_name[name[:60]] = by_name.get(name[:60], 0.0) + dur / calls
    return dict(kernels=len(ev) / calls, busy_us=sum(e[2] for e in ev) / calls,
                span_us=(max(s + d for _, s, d in ev) - min(s for _, s, _ in ev)) / calls,
                by_name=by_name)


def profile_program(program, args, calls: int, top: int = 6) -> dict:
    """Runs ``program(*args)`` (already compiled: a warm call) once under the profiler;
    ``per_call`` of its GPU events with ``by_name`` cut to the ``top`` largest kernels as
    ``top_kernels_us``; {"kernels": None} when the trace has no GPU events."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(program(*args))
        got = per_call(gpu_events(pathlib.Path(tmp)), calls)
    if not got:
        return {"kernels": None}
    by_name = got.pop("by_name")
    return got | {"top_kernels_us": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:top])}
