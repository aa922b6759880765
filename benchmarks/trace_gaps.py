"""Where the GPU waits in a profiled step: idle gaps between consecutive GPU kernels of a
chrome trace (``trace_*.json.gz`` from ``decode_profile_gpu.py`` / ``experiments.scale``),
grouped by the kernel pair around them, and the host events running during the largest one.

    python3 benchmarks/trace_gaps.py --after pq_scores \
        results/decode_profile_session31/b8/trace_leansparse_fp8_jt_131072_8.json.gz

Session 31 found with it that LeanSparse's batch-8 step at 128K idles ~300 us a step between
``pq_scores_kernel`` and ``topk_fused_threshold`` while the host updates and launches the
CUDA graph that follows (``command_buffer::update``, ``cuGraphLaunch``).
Notation: a gap is next.start - (previous.start + previous.duration), in us, on the GPU
process's events sorted by start (all streams together: overlap counts as no gap).
"""

from __future__ import annotations

import argparse
import collections

from experiments.profiling import read_trace


def load(path: str) -> tuple[list[dict], list[dict]]:
    """(GPU events by start, host events): the trace's complete ('X') events split by
    process (``experiments.profiling.read_trace``)."""
    events, gpu_pids = read_trace(path)
    done = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in done if e["pid"] in gpu_pids), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError(f"{path}: no GPU process with events in the trace")
    return gpu, [e for e in done if e["pid"] not in gpu_pids]


def gaps(gpu: list[dict], min_us: float = 3.0) -> list[tuple[str, str, float, float]]:
    """(previous kernel, next kernel, gap us, gap start) for each gap of at least ``min_us``;
    the previous kernel is the one ending last so far (streams may overlap)."""
    out, end, last = [], None, None
    for e in gpu:
        if end is not None and e["ts"] - end >= min_us:
            out.append((last, e["name"], e["ts"] - end, end))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e["name"]
    return out


def by_pair(found) -> list[tuple[tuple[str, str], float, int]]:
    """Gaps summed per (previous, next) kernel pair, largest total first."""
    total, count = collections.Counter(), collections.Counter()
    for a, b, g, _ in found:
        total[(a, b)] += g
        count[(a, b)] += 1
    return [(k, total[k], count[k]) for k, _ in total.most_common()]


def host_during(host: list[dict], start: float, stop: float, min_us: float = 2.0) -> list[dict]:
    """Host events overlapping [start, stop] and lasting at least ``min_us``, by start."""
    return sorted((e for e in host if e["ts"] <= stop and e["ts"] + e.get("dur", 0) >= start
                   and e.get("dur", 0) >= min_us), key=lambda e: e["ts"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=3.0)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--after", default="", help="show the host during the largest gap after a "
                    "kernel whose name starts with this (default: the largest gap)")
    args = ap.parse_args(argv)
    gpu, host = load(args.trace)
    found = gaps(gpu, args.min_us)
    print(f"{len(gpu)} GPU events, {len(found)} gaps >= {args.min_us} us, "
          f"{sum(g for *_, g, _ in found):.1f} us idle")
    for (a, b), us, n in by_pair(found)[:args.top]:
        print(f"{us:10.1f} us {n:4d}x  {a[:40]} -> {b[:40]}")
    chosen = [x for x in found if x[0].startswith(args.after)]
    if args.after and not chosen:
        raise SystemExit(f"no gap after a kernel named {args.after!r}*")
    if chosen:
        a, b, g, start = max(chosen, key=lambda x: x[2])
        print(f"largest gap {g:.1f} us ({a} -> {b}); host events during it:")
        for e in host_during(host, start, start + g):
            print(f"  {e['ts'] - start:9.1f} {e['dur']:9.1f}  {e['name'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
