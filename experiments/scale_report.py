"""The scale study's table and plot from committed results (issue 13, deliver 6).

    python -m experiments.scale_report                       # print the tables
    python -m experiments.scale_report --readme README.md --plot results/scale/scale_all.png \
        --json results/scale/all_cells.json

Reads ``<runs>/<name>/results.json`` for the runs of ``RUNS`` (newest first: a cell measured
in several runs is taken from the newest), prints two markdown tables and optionally writes
them into the README between ``<!-- scale-table:begin -->`` and ``<!-- scale-table:end -->``
and draws the plot:
  1. decode step (ms) per method at each (context, batch), LeanSparse / HiSparse, request
     groups / LeanSparse (each ratio from one run: the numerator's; where both cells timed
     several blocks, ``scale.repeats``, with the range the blocks allow), prefill seconds (with the
     matmul precision and, where not f32, the KV row format), the run it came from;
  2. per request: device bytes of the 4-layer slice (measured allocation) and, for the whole
     43-layer V4-Flash pattern, device bytes (``memory.accounting``, exact for that pattern)
     and the step scaled by layer count (``scale.extrapolate``: an extrapolation, labelled).
``--json`` writes the merged records (one per cell, each with its ``run``) as one file.
Records without ``full_model`` get it from ``scale.extrapolate`` at scale.gin's settings
(HiSparse B = 4096, page 64, LeanSparse C = 2048 with a 4096-row key cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from experiments.common import block_ratio_range, fit_max_len, pyplot
from experiments.scale import PROFILED_STEPS, extrapolate
from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.model import preset

RUNS = ("scale_small_batch_fp8_s37", "scale_small_batch_fp8_s36", "scale_small_batch_1m_s35",
        "scale_small_batch_s33", "scale_small_batch_s32", "scale_small_batch_s30",
        "scale_small_batch_1m", "scale_small_batch",
        "scale_batch_1m_fp8_swizzle",
        "scale_lean_jt_swizzle", "scale_lean_jt", "scale_batch_1m_fp8", "scale_batch_1m",
        "scale_batch_short", "scale_batch",
        "scale_long", "scale_v2", "scale")  # newest first
METHODS = ("resident", "hisparse", "leansparse", "leansparse_g2", "leansparse_fp8_jt",
           "adaptive")
FULL_PATTERN = ("swa", "swa") + ("csa", "hca") * 20 + ("csa",)  # V4-Flash: 43 layers
BEGIN, END = "<!-- scale-table:begin -->", "<!-- scale-table:end -->"


def load(root: pathlib.Path, names=RUNS) -> list[dict]:
    """One record per (method, context, batch) with a step time, from the newest run holding
    it; each gets ``run`` (its run name) and ``full_model`` (see the module docstring)."""
    cells: dict[tuple, dict] = {}
    for name in names:
        path = root / name / "results.json"
        if not path.exists():
            continue
        results = json.loads(path.read_text())
        peers: dict[tuple, dict] = {}  # this run's step times per (context, batch) by method
        blocks: dict[tuple, dict] = {}  # and its timed blocks (scale.repeats > 1)
        for rec in results["records"]:
            if "step_ms" in rec:
                at = (rec["context"], rec["batch"])
                peers.setdefault(at, {})[rec["method"]] = rec["step_ms"]
                if "step_ms_blocks" in rec:
                    blocks.setdefault(at, {})[rec["method"]] = rec["step_ms_blocks"]
        for rec in results["records"]:
            key = (rec["method"], rec["context"], rec["batch"])
            if "step_ms" in rec and key not in cells:
                rec = dict(rec, run=name, peers=peers[key[1:]],
                           **({"peer_blocks": blocks[key[1:]]} if key[1:] in blocks else {}),
                           precision=results["model"].get("matmul_precision", "highest"),
                           kv_dtype=results["model"].get("kv_dtype", "f32"))
                if "full_model" not in rec:
                    rec["full_model"] = _full_model(results["model"], rec)
                cells[key] = rec
    return sorted(cells.values(), key=lambda r: (r["context"], r["batch"], r["method"]))


def _full_model(model: dict, rec: dict) -> dict:
    """``scale.extrapolate`` of a record of a run of the v4_flash slice (scale.gin settings)."""
    fields = dict(model, layer_pattern=tuple(model["layer_pattern"]))
    base = preset("v4_flash", **{k: fields[k] for k in ("layer_pattern", "matmul_precision",
                                                        "kv_dtype") if k in fields})
    got = dataclasses.asdict(base)  # fields older runs did not record keep their defaults
    same = [k for k in fields if k in got and k not in ("max_len", "layer_pattern")]
    if any(got[k] != fields[k] for k in same):
        raise ValueError(f"scale_report: run {rec.get('run')} is not the v4_flash preset's "
                         "slice; its records need their own full_model")
    cfg = fit_max_len(base, rec["context"] + 16 + 4 + PROFILED_STEPS + 2)
    lean = LeanSparseConfig(num_candidates=2048, key_cache_rows=4096, miss_filter_offset=1.0)
    return extrapolate(cfg, rec, FULL_PATTERN, 4096, 64, lean)


def _label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else str(n)


def _ratio(cell: dict, a: str, b: str) -> str:
    """a's step over b's, both from a's run; where both cells timed several blocks, also the
    widest range the blocks allow: [min a / max b, max a / min b]."""
    if a not in cell or b not in cell[a]["peers"]:
        return ""
    text = f"{cell[a]['step_ms'] / cell[a]['peers'][b]:.2f}"
    runs = cell[a].get("peer_blocks", {})  # absent where the run timed one block a cell
    mine, theirs = runs.get(a), runs.get(b)
    if mine and theirs:
        lo, hi = block_ratio_range(mine, theirs)
        text += f" [{lo:.2f}-{hi:.2f}]"
    return text


def step_table(records) -> str:
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    head = ["context", "batch", *methods, "lean / his"]
    if "leansparse_g2" in methods:
        head.append("g2 / lean")
    if "leansparse_fp8_jt" in methods:
        head.append("fp8_jt / his")
    head += ["prefill s, newest run (matmuls; KV rows if not f32)", "run"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for context, batch in sorted({(r["context"], r["batch"]) for r in records}):
        cell = {r["method"]: r for r in records
                if r["context"] == context and r["batch"] == batch}
        ms = {m: cell[m]["step_ms"] for m in cell}
        # a ratio takes both methods from the numerator's run (runs of other sessions ran
        # other code: HiSparse at 512K batch 8 took 5.75 ms in scale_batch, 3.91 in session 28)
        line = [_label(context), str(batch)] + [f"{ms[m]:.2f}" if m in ms else ""
                                                for m in methods]
        line.append(_ratio(cell, "leansparse", "hisparse"))
        if "leansparse_g2" in methods:
            line.append(_ratio(cell, "leansparse_g2", "leansparse"))
        if "leansparse_fp8_jt" in methods:
            line.append(_ratio(cell, "leansparse_fp8_jt", "hisparse"))
        # the newest run's prefill, its fastest where calls of one run prefilled anew (an
        # older measurement may predate a faster prefill path: index_logits, session 26)
        pre = min(cell.values(), key=lambda r: (RUNS.index(r["run"]) if r["run"] in RUNS
                                                else len(RUNS), r["prefill_s"]))
        rows_fmt = sorted({r["kv_dtype"] for r in cell.values()} - {"f32"})
        line.append(f"{pre['prefill_s']:.1f} ({', '.join([pre['precision'], *rows_fmt])})")
        line.append(", ".join(sorted({r["run"] for r in cell.values()})))
        rows.append("| " + " | ".join(line) + " |")
    return "\n".join(rows)


def bytes_table(records) -> str:
    """Per context and method, at the largest batch measured: slice bytes (measured), and the
    43-layer bytes (accounting) and step (extrapolated)."""
    rows = ["| context | method | batch | slice: device MB / request (measured) | "
            "43 layers: device GB / request (accounting) | 43 layers: step ms "
            "(EXTRAPOLATED: slice step x 43 / 4) |", "|---:|---|---:|---:|---:|---:|"]
    for context in sorted({r["context"] for r in records}):
        for method in METHODS:
            here = [r for r in records if r["context"] == context and r["method"] == method]
            if not here:
                continue
            r = max(here, key=lambda x: x["batch"])
            full = r["full_model"]
            rows.append(f"| {_label(context)} | {method} | {r['batch']} | "
                        f"{r['device_bytes_per_request'] / 1e6:.1f} | "
                        f"{full['device_bytes_per_request'] / 1e9:.2f} | "
                        f"{full['step_ms_extrapolated']:.0f} |")
    return "\n".join(rows)


def plot(records, path: pathlib.Path) -> None:
    """(a) step ms by context at each batch, (b) step ms by batch at each context measured at
    two batches or more, (c) device MB per request (slice) by context."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    styles = {1: ":", 8: "-", 32: "--", 64: "-."}
    for m in methods:
        for batch in sorted({r["batch"] for r in records}):
            pts = sorted((r["context"], r["step_ms"]) for r in records
                         if r["method"] == m and r["batch"] == batch)
            if pts:
                axes[0].plot(*zip(*pts), styles.get(batch, "-"), marker="o", color=colors[m],
                             label=f"{m} B={batch}", markersize=3)
        wide = [c for c in sorted({r["context"] for r in records})
                if len({r["batch"] for r in records if r["context"] == c}) >= 2]
        for context in wide:
            pts = sorted((r["batch"], r["step_ms"]) for r in records
                         if r["method"] == m and r["context"] == context)
            if pts:
                axes[1].plot(*zip(*pts), marker="o", color=colors[m],
                             label=f"{m} {_label(context)}")
        pts = sorted({(r["context"], r["device_bytes_per_request"] / 1e6) for r in records
                      if r["method"] == m})
        axes[2].plot(*zip(*pts), marker="o", color=colors[m], label=m)
    axes[0].set(xscale="log", xlabel="context (tokens)", ylabel="decode step (ms)",
                title="(a) step by context (4-layer slice)")
    axes[0].set_xscale("log", base=2)
    axes[1].set(xlabel="batch (requests)", ylabel="decode step (ms)",
                title="(b) step by batch")
    axes[1].set_xscale("log", base=2)
    axes[2].set(xlabel="context (tokens)", ylabel="device MB / request",
                title="(c) per-request device state (slice)")
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme_block(records) -> str:
    runs = ", ".join(f"`results/{n}/`" for n in RUNS if any(r["run"] == n for r in records))
    return (f"{BEGIN}\n<!-- generated by `python -m experiments.scale_report --readme README.md"
            f"` from {runs}; do not edit by hand -->\n"
            "Decode step (ms; wall time of `Engine.step`, mean of 16 steps after 4 warm ones; "
            "4-layer V4-Flash slice, random weights, Triton kernels; leansparse_g2 = "
            "`LeanSparseConfig.groups = 2`; leansparse_fp8_jt = its FP8 coarse pass through "
            "the jax-triton kernel; each cell from the newest run holding it, each ratio from "
            "one run, the numerator's):\n\n" + step_table(records) + "\n\n"
            "Per request, at the largest batch measured. The 43-layer step is an "
            "extrapolation (the slice's step scaled by layer count, fixed per-step costs "
            "scaled too), not a measurement; the 43-layer bytes are the accounting of the "
            "whole pattern (exact for this implementation):\n\n" + bytes_table(records)
            + f"\n{END}")


def write_readme(path: pathlib.Path, records) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"scale_report: {path} has no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + readme_block(records) + rest.split(END, 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="results", help="folder of the run folders")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    ap.add_argument("--readme", default=None, help="README to rewrite the table block of")
    ap.add_argument("--plot", default=None, help="PNG to draw")
    ap.add_argument("--json", default=None, help="JSON file of the merged records to write")
    args = ap.parse_args(argv)
    names = tuple(args.only.split(",")) if args.only else RUNS
    records = load(pathlib.Path(args.runs), names)
    if not records:
        print(f"scale_report: no records under {args.runs} for runs {names}")
        return 1
    print(step_table(records) + "\n\n" + bytes_table(records))
    if args.readme:
        write_readme(pathlib.Path(args.readme), records)
    if args.plot:
        plot(records, pathlib.Path(args.plot))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"runs": [n for n in names if any(r["run"] == n for r in records)],
             "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
