"""Shared trace reading for the GPU benchmark scripts (``python3 benchmarks/<script>.py``)."""

import gzip
import json
import pathlib


def gpu_events(trace_dir: pathlib.Path) -> list[tuple[str, float, float]]:
    """(name, start_us, dur_us) of the GPU events of the newest Perfetto trace under
    ``trace_dir`` (``jax.profiler.trace(..., create_perfetto_trace=True)``), in start order;
    [] when there is none."""
    found = sorted(trace_dir.rglob("*trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        return []
    data = json.load(gzip.open(found[-1]))
    ev = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
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
