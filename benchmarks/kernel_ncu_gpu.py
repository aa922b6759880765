"""Hardware counters of the issue-16 kernels at their target shapes (Nsight Compute), to measure
what bounds each one where timing alone could not (benchmarks/RESULTS.md "Issue 16: where each
kernel target stands": the pq_topc score kernel, topk's select kernel, index_scores and
sparse_attention v2 have no measured bound).

Two modes:
  --op OP --impl IMPL   (the child, run under ncu) builds the kernel_compare case at its
                        headline shape, calls the op once to compile and once more, and exits;
                        ncu's kernel-name filter keeps only the op's own kernels.
  --summarize CSV...    reads ncu's `--csv --page raw` output and prints / writes one row per
                        kernel: duration, DRAM and SM throughput (% of peak), tensor-pipe
                        activity, achieved occupancy, registers, shared memory, the three
                        largest warp-stall reasons (cycles per issued instruction), and
                        shared-memory instructions, wavefronts and bank conflicts (loads and
                        stores apart) where the CSV has them.
  --sass CSV...         reads ncu's `--page source --csv --print-source sass` output (one
                        or more kernels) and prints / writes, per kernel, where the warp-stall
                        samples fall: the instructions holding the most and the totals by
                        opcode (a stall is charged to the instruction that waits; its cause is
                        an earlier one, e.g. the load whose register it reads).
Ops beyond the four targets: pq_topc_zero_codes (the score kernel with every code 0),
pq_topc_linear (with the row-major codebook, no bank swizzle), sparse_attention_mosaic and
sparse_attention_mosaic_unrolled (the Mosaic GPU kernel, its row copies issued by a loop or
unrolled).
Run by benchmarks/kernel_ncu_gpu.sh on the GPU machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys

OPS = {  # op -> (implementation, ncu kernel-name regex)
    "pq_topc": ("jax_triton", "pq_scores|topk_select|topk_finish"),
    # the score kernel with every code 0 (2.4x faster in session 25's ablation: bank
    # conflicts of the row-major book, session 26's counters)
    "pq_topc_zero_codes": ("jax_triton", "pq_scores"),
    # the score kernel with the row-major book (decode "smem_linear"; default: bank swizzle)
    "pq_topc_linear": ("jax_triton_linear", "pq_scores"),
    "topk": ("triton_fused", "topk_fused"),
    "index_scores": ("triton_fp8", "index_scores"),
    # index_scores' split top-512 form: the score kernel, then candidate_topk on its scores
    "index_top512": ("triton_fp8_split_top512", "candidate_topk|index_scores"),
    "sparse_attention": ("triton", "sparse_attention"),
    # Mosaic GPU names a kernel after its body's __name__, "anonymous" for mosaic.py's
    # functools.partial (jax/_src/pallas/mosaic_gpu/core.py::kernel)
    "sparse_attention_mosaic": ("mosaic", "anonymous|body|mosaic"),
    # the same kernel with its 64 row copies unrolled (mosaic.default_config's row_loop=False;
    # the default issues them from a loop since session 27)
    "sparse_attention_mosaic_unrolled": ("mosaic_unrolled", "anonymous|body|mosaic"),
}
METRICS = {  # column -> ncu raw metric
    "duration_us": "gpu__time_duration.sum",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "smem_static": "launch__shared_mem_per_block_static",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    # shared memory: wavefronts (the data pipe's work, bank-conflict replays included) and the
    # conflicts among them, loads and stores apart
    "smem_ld_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "smem_ld_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "smem_st_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "smem_st_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "smem_ld_inst": "smsp__inst_executed_op_shared_ld.sum",
    "smem_st_inst": "smsp__inst_executed_op_shared_st.sum",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"  # ..._<reason>_per_issue_active.ratio
STALL_SUFFIX = "_per_issue_active.ratio"


def child(op: str, impl: str) -> None:
    import jax

    from experiments import kernel_compare as kc
    from experiments.cases.sparse_attention import sparse_attention_case

    # sparse_attention_mosaic(_loop) profiles the Mosaic kernel at the Triton kernel's case
    case = {"pq_topc": lambda: kc.pq_topc_case(64, 131072),
            "topk": lambda: kc.topk_case(64, 262144, 2048),
            "index_scores": lambda: kc.index_scores_case(64),
            "index_top512": lambda: kc.index_scores_case(64),
            "sparse_attention": lambda: sparse_attention_case(64)}[
        op.split("_mosaic")[0].removesuffix("_zero_codes").removesuffix("_linear")]()
    args = case.make(jax.random.key(0))
    if op.endswith("_zero_codes"):  # q, w, codes, books, lengths
        args = (*args[:2], jax.numpy.zeros_like(args[2]), *args[3:])
    args = jax.block_until_ready(args)
    if impl == "mosaic_unrolled":
        from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic
        fn = jax.jit(lambda *a: sparse_attention_mosaic(*a, row_loop=False))
    else:
        fn = jax.jit(lambda *a: case.call(impl, *a))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    print(f"{op} ({impl}) at {case.params}: called twice", flush=True)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(paths: list[str]) -> list[dict]:
    """One row per profiled kernel launch of ncu's raw CSV (header row, units row, data)."""
    rows = []
    for path in paths:
        lines = [ln for ln in pathlib.Path(path).read_text().splitlines() if ln.startswith('"')]
        if len(lines) < 3:
            print(f"{path}: no kernel rows (ncu could not profile; see its log)")
            continue
        table = list(csv.reader(lines))
        head, units = table[0], table[1]
        for values in table[2:]:
            rec = dict(zip(head, values))
            unit = dict(zip(head, units))
            row = {"file": pathlib.Path(path).name, "kernel": rec.get("Kernel Name", "?")[:60]}
            for col, metric in METRICS.items():
                val = _number(rec.get(metric, ""))
                if col == "duration_us" and val is not None:  # ncu reports ns, us or ms
                    val *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(
                        unit.get(metric, "nsecond"), 1e-3)
                row[col] = val
            stalls = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: _number(v)
                      for k, v in rec.items()
                      if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)
                      and "not_issued" not in k}
            stalls = {k: v for k, v in stalls.items() if v is not None}
            row["top_stalls"] = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
            rows.append(row)
    return rows


def _segments(path: str) -> list[tuple[str, list[dict]]]:
    """ncu's source page as (kernel, rows): a header row is one with a "Source" cell; the rows
    after it, until the next header, are one kernel's instructions (the kernel named by the
    last non-CSV line before the header, else by the file)."""
    segs, head, name = [], None, pathlib.Path(path).stem
    for line in pathlib.Path(path).read_text(errors="replace").splitlines():
        if not line.startswith('"'):
            if line.strip():
                name = line.strip()[:80]
            continue
        cells = next(csv.reader([line]))
        if cells[0] == "Kernel Name" and len(cells) > 1:  # ncu 2025: "Kernel Name","<name>",
            name, head = cells[1][:80], None
        elif any(c.strip().lower() == "source" for c in cells):
            head = [c.strip() for c in cells]
            segs.append((name, []))
        elif head is not None:
            segs[-1][1].append(dict(zip(head, cells)))
    return segs


def sass_summary(paths: list[str], top: int = 40) -> list[dict]:
    """Per kernel of each source-page CSV: total stall samples, the ``top`` instructions by
    samples (address, SASS, samples, share, their largest stall reasons) and the samples by
    opcode (the SASS's first token, predicate dropped) and by stall reason (``stall_*``
    columns)."""
    out = []
    for path in paths:
        for name, rows in _segments(path):
            if not rows:
                continue
            cols = list(rows[0])
            samp = next((c for c in cols if "Sampling (All" in c), None) or next(
                (c for c in cols if "Sampl" in c), None)
            if samp is None:
                print(f"{path}: no sampling column in {cols}")
                continue
            addr = next((c for c in cols if "Address" in c), cols[0])
            reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
            insts = []
            for index, r in enumerate(rows):
                n = _number(r.get(samp, "")) or 0.0
                src = r.get("Source", "").strip()
                op = src.split()[1] if src.startswith("@") and len(src.split()) > 1 else (
                    src.split() or ["?"])[0]
                why = {c[len("stall_"):]: _number(r.get(c, "")) or 0.0 for c in reasons}
                insts.append({"index": index, "address": r.get(addr, ""), "sass": src,
                              "samples": n, "opcode": op.rstrip(";"), "stalls": why})
            total = sum(i["samples"] for i in insts) or 1.0
            by_op: dict[str, float] = {}
            by_why: dict[str, float] = {}
            for i in insts:
                by_op[i["opcode"]] = by_op.get(i["opcode"], 0.0) + i["samples"]
                for k, v in i["stalls"].items():
                    by_why[k] = by_why.get(k, 0.0) + v
            ranked = sorted(insts, key=lambda i: -i["samples"])[:top]
            for i in ranked:
                i["share"] = i["samples"] / total
                i["stalls"] = dict(sorted(((k, v) for k, v in i["stalls"].items() if v),
                                          key=lambda kv: -kv[1])[:3])
            for i in insts:
                if "share" not in i:
                    i.pop("stalls")
            out.append({"file": pathlib.Path(path).name, "kernel": name, "columns": cols,
                        "instructions": len(insts), "samples": total, "top": ranked,
                        "by_opcode": sorted(((k, v / total) for k, v in by_op.items()),
                                            key=lambda kv: -kv[1])[:25],
                        "by_stall": sorted(((k, v / total) for k, v in by_why.items() if v),
                                           key=lambda kv: -kv[1])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=sorted(OPS))
    ap.add_argument("--impl", default=None, help="default: the op's entry in OPS")
    ap.add_argument("--summarize", nargs="*", default=None, metavar="CSV")
    ap.add_argument("--sass", nargs="*", default=None, metavar="CSV")
    ap.add_argument("--json", default=None, help="with --summarize / --sass: write the rows here")
    ap.add_argument("--regex", action="store_true", help="print the op's kernel regex and exit")
    args = ap.parse_args()
    if args.sass is not None:
        recs = sass_summary(args.sass)
        for rec in recs:
            print(f"== {rec['file']} {rec['kernel']}: {rec['instructions']} instructions, "
                  f"{rec['samples']:.0f} samples")
            print("   by opcode: " + ", ".join(f"{k} {v:.1%}" for k, v in rec["by_opcode"][:14]))
            print("   by stall: " + ", ".join(f"{k} {v:.1%}" for k, v in rec["by_stall"][:8]))
            for i in rec["top"][:24]:
                why = " ".join(f"{k}:{v:.0f}" for k, v in i["stalls"].items())
                print(f"   #{i['index']:<5} {i['share']:6.1%}  {i['sass'][:64]:64} {why}")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(recs, indent=1))
        return
    if args.summarize is not None:
        rows = summarize(args.summarize)
        for r in rows:
            stalls = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"])
            smem = (r["smem_static"] or 0) + (r["smem_dynamic"] or 0)
            print(f"{r['kernel'][:32]:32} {r['duration_us'] or 0:9.1f} us  dram "
                  f"{r['dram_pct'] or 0:5.1f}%  sm {r['sm_pct'] or 0:5.1f}%  tensor "
                  f"{r['tensor_pct'] or 0:5.1f}%  occ {r['occupancy_pct'] or 0:5.1f}%  regs "
                  f"{r['registers'] or 0:.0f}  smem {smem:.0f}  stalls: {stalls}")
            if r.get("smem_ld_wavefronts") is not None:  # the shared-memory counters
                print("    shared ld: %.3g inst %.3g wavefronts %.3g conflicts | st: %.3g inst "
                      "%.3g wavefronts %.3g conflicts" % tuple(r.get(k) or 0 for k in (
                          "smem_ld_inst", "smem_ld_wavefronts", "smem_ld_conflicts",
                          "smem_st_inst", "smem_st_wavefronts", "smem_st_conflicts")))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    if args.op is None:
        sys.exit("give --op or --summarize")
    if args.regex:
        print(OPS[args.op][1])
        return
    child(args.op, args.impl or OPS[args.op][0])


if __name__ == "__main__":
    main()
