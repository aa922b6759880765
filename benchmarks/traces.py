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
