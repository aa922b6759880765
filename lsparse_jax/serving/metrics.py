"""Serving latency metrics from a request's timestamps (the papers' definitions).

TTFT = first token time - arrival time; TPOT = (last token time - first token time) /
(tokens - 1), the mean inter-token gap (undefined for a single token); end-to-end = finish time
- arrival time; queueing = admission time - arrival time. Throughput = output tokens over the
run, from the first arrival to the last finish.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lsparse_jax.serving.request import Request

PERCENTILES = (50, 95, 99)


def request_metrics(r: Request) -> dict:
    """One finished request's record: its id, lengths, timestamps and latencies (seconds)."""
    if r.first_token_at is None or r.finished_at is None or not r.tokens:
        raise ValueError(f"request_metrics: request {r.id!r} has not finished")
    n = len(r.tokens)
    return {
        "id": r.id, "session": r.session, "turn": r.turn,
        "prompt_tokens": int(len(r.prompt)), "output_tokens": n,
        "finish_reason": r.finish_reason, "admission_waits": r.admission_waits,
        "arrival_s": r.arrival_time, "admitted_s": r.admitted_at,
        "first_token_s": r.first_token_at, "finished_s": r.finished_at,
        "queue_s": r.admitted_at - r.arrival_time,
        "ttft_s": r.first_token_at - r.arrival_time,
        "tpot_s": (r.token_times[-1] - r.token_times[0]) / (n - 1) if n > 1 else None,
        "e2e_s": r.finished_at - r.arrival_time,
    }


def percentiles(values: Sequence[float | None], name: str) -> dict:
    """{name_p50_s, name_p95_s, name_p99_s} over the defined values (None where none are)."""
    xs = np.asarray([v for v in values if v is not None], np.float64)
    return {f"{name}_p{q}_s": float(np.percentile(xs, q)) if xs.size else None
            for q in PERCENTILES}


def summarize(records: Sequence[dict]) -> dict:
    """Aggregates of request records: completed, p50/p95/p99 of TTFT, TPOT, end-to-end and
    queueing, output tokens, run time and throughput."""
    out = {"completed": len(records)}
    for name in ("ttft", "tpot", "e2e", "queue"):
        out |= percentiles([r[f"{name}_s"] for r in records], name)
    tokens, span, rate = throughput(records)
    return out | {"output_tokens": tokens, "run_time_s": span, "throughput_tok_s": rate}


def throughput(records: Sequence[dict]) -> tuple[int, float, float | None]:
    """(output tokens, span from the first arrival to the last finish in seconds, tokens per
    second over that span, None for an empty span) of request records."""
    tokens = sum(r["output_tokens"] for r in records)
    span = (max(r["finished_s"] for r in records) - min(r["arrival_s"] for r in records)
            if records else 0.0)
    return tokens, span, tokens / span if span > 0 else None


def steady_state(trace: Sequence[dict]) -> dict:
    """The iteration time while the most requests were decoding, from a scheduler's trace
    (``Scheduler.trace``: one entry per iteration, its clock time and active count at the
    iteration's end): the intervals between consecutive entries that both show the most
    active requests (so no admission or finish changed the batch within them).

    Returns {"most_active", "steady_iterations" (intervals counted), "steady_iteration_p50_s"
    (their median; None if there are none)}. Steady tokens/s are then about most_active x
    tokens per request-iteration / steady_iteration_p50_s."""
    active = np.asarray([t["active"] for t in trace], np.int64)
    times = np.asarray([t["time_s"] for t in trace], np.float64)
    most = int(active.max()) if active.size else 0
    keep = (active[1:] == most) & (active[:-1] == most) & (most > 0)
    gaps = np.diff(times)[keep]
    return {"most_active": most, "steady_iterations": int(gaps.size),
            "steady_iteration_p50_s": float(np.median(gaps)) if gaps.size else None}


__all__ = ["PERCENTILES", "percentiles", "request_metrics", "steady_state", "summarize",
           "throughput"]
