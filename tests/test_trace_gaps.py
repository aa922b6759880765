"""benchmarks/trace_gaps.py on a synthetic chrome trace: exact gap sums, streams that overlap
count as busy, host events found by overlap, a trace without a GPU process refused."""

import gzip
import importlib.util
import json
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "trace_gaps", pathlib.Path(__file__).parents[1] / "benchmarks" / "trace_gaps.py")
trace_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gaps)


def write(tmp_path, events, gpu=True):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    if gpu:
        meta.append({"ph": "M", "name": "process_name", "pid": 2,
                     "args": {"name": "/device:GPU:0"}})
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return str(path)


def kernel(name, ts, dur, tid=0):
    return {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_gaps_pairs_and_host_events(tmp_path, capsys):
    events = [kernel("a", 0, 10), kernel("b", 30, 5),   # gap 20 after a
              kernel("c", 36, 20, tid=1), kernel("d", 40, 4),  # d inside c: no gap
              kernel("a", 100, 10), kernel("b", 112, 5),  # gap 44 after c, 2 after a (< 3)
              kernel("a", 200, 10), kernel("b", 240, 1),  # gap 83 after b, 30 after a
              {"ph": "X", "pid": 1, "tid": 0, "name": "graph update", "ts": 215, "dur": 20},
              {"ph": "X", "pid": 1, "tid": 0, "name": "earlier", "ts": 0, "dur": 50}]
    gpu, host = trace_gaps.load(write(tmp_path, events))
    found = trace_gaps.gaps(gpu)
    assert [(a, b, g) for a, b, g, _ in found] == [
        ("a", "b", 20), ("c", "a", 44), ("b", "a", 83), ("a", "b", 30)]
    assert trace_gaps.by_pair(found) == [(("b", "a"), 83, 1), (("a", "b"), 50, 2),
                                         (("c", "a"), 44, 1)]
    names = [e["name"] for e in trace_gaps.host_during(host, 210, 240)]
    assert names == ["graph update"]
    assert trace_gaps.main(["--after", "a", write(tmp_path, events)]) == 0
    out = capsys.readouterr().out
    assert "largest gap 30.0 us (a -> b)" in out and "graph update" in out
    with pytest.raises(SystemExit, match="no gap after"):
        trace_gaps.main(["--after", "zzz", write(tmp_path, events)])


def test_trace_without_gpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no GPU process"):
        trace_gaps.load(write(tmp_path, [kernel("a", 0, 1)], gpu=False))
