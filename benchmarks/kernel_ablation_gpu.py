"""Where the issue-16 kernels spend their time, by input ablations (no hardware counters
needed): each op timed at its target shape and at variants that change one thing, interleaved
over --rounds rounds so the run-to-run spread is measured beside the differences.

- sparse_attention (triton v2, bf16, B 64, W 128): K = 512 (target) vs K = 256 and K = 16. Time
  against K + W is a line: its slope is the cost of a selected row, its intercept the fixed part
  (launch, q load, combine).
- pq_topc's score kernel alone (jax_triton ``coarse_scores_jax_triton``, B 64; 94% of the op
  in session 21's profile): N = 131072 (target) vs N = 65536 (slope and intercept), and
  N = 131072 with every code 0 (every key decodes from codebook row 0; session 25 measured
  2.4x faster). The score kernel alone, because with one code every score ties, which would
  change top-C's work. Two variants split that difference: codes per key (a key's subspaces
  all take its first code: keys differ) and codes per subspace (every key takes the first
  key's codes: keys alike). Session 26: only the second is fast, so the slow part is
  different keys' gathers meeting in one warp instruction: with the row-major book all lanes
  of a gather hit one bank (``pq_topc.jax_triton``'s module docstring). Session 27: the bank
  swizzle ("smem", the default until session 28's "smem_lanes") against the row-major book
  ("smem_linear") and the shuffle decode, random and zero codes, bf16 and fp8 books; and
  512-key tiles (the book's per-tile re-staging halved per key).
- topk (triton_fused, 64 rows, k 2048): N = 262144 (target) vs N = 131072.
- index_scores (triton_fp8, B 64): C = 2048 (target) vs C = 1024.

Times as kernel_compare does (benchmarks/timing.py::program_time: one jitted program over 4
input sets, median of 10 programs). Writes kernel_ablation.json to --out after every variant.
Run on the GPU machine: PYTHONPATH=$PWD python3 benchmarks/kernel_ablation_gpu.py --out $OUT
(--dry: tiny shapes with the XLA implementations on CPU, checks the script runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import program_time  # benchmarks/timing.py

from experiments import kernel_compare as kc
from experiments.cases.sparse_attention import sparse_attention_case


def zero_codes(args):
    q, w, codes, books, lengths = args
    return q, w, jnp.zeros_like(codes), books, lengths


def codes_per_key(args):
    """Every subspace of a key takes the key's first code: keys differ, a key's subspaces
    gather the same book row."""
    q, w, codes, books, lengths = args
    return q, w, jnp.broadcast_to(codes[:, :, :1], codes.shape), books, lengths


def codes_per_subspace(args):
    """Every key takes the first key's codes: subspaces differ, all keys decode alike."""
    q, w, codes, books, lengths = args
    return q, w, jnp.broadcast_to(codes[:, :1, :], codes.shape), books, lengths


def pq_scores(impl, decode: str = "smem", precision: str = "bf16", **launch):
    """The op of the pq_topc rows: the score kernel alone (jax_triton, with this gather
    lowering, book precision and launch parameters) or, for --dry, the XLA op whole (the
    kernel needs a GPU)."""
    if impl == "xla":
        return lambda case, *a: case.call("xla", *a)
    from pallas_kernels.pq_topc.jax_triton import Params, coarse_scores_jax_triton

    params = Params(decode=decode, **launch)
    return lambda case, *a: coarse_scores_jax_triton(*a, params=params, precision=precision)


def variants(dry: bool):
    """(op, label, case, fn(case, *args), transform of the made arguments or None)."""
    def op_of(impl):
        return lambda case, *a: case.call(impl, *a)

    if dry:
        return [("sparse_attention", "K=16", sparse_attention_case(2, k=16, window=8, heads=16,
                                                                   dim=128, rows=64),
                 op_of("xla"), None),
                ("pq_topc", "N=1024 zero codes", kc.pq_topc_case(2, 1024, c=64),
                 pq_scores("xla"), zero_codes),
                ("pq_topc", "N=1024 codes per key", kc.pq_topc_case(2, 1024, c=64),
                 pq_scores("xla"), codes_per_key),
                ("pq_topc", "N=1024 codes per subspace", kc.pq_topc_case(2, 1024, c=64),
                 pq_scores("xla"), codes_per_subspace),
                ("topk", "N=4096", kc.topk_case(2, 4096, 64), op_of("xla"), None),
                ("index_scores", "C=256", kc.index_scores_case(2, c=256), op_of("xla"), None)]
    out = []
    for k in (512, 256, 16):
        out.append(("sparse_attention", f"K={k}", sparse_attention_case(64, k=k),
                    op_of("triton"), None))
    scores = pq_scores("jax_triton")
    out += [("pq_scores", "N=131072", kc.pq_topc_case(64, 131072), scores, None),
            ("pq_scores", "N=65536", kc.pq_topc_case(64, 65536), scores, None),
            ("pq_scores", "N=131072 zero codes", kc.pq_topc_case(64, 131072), scores,
             zero_codes),
            ("pq_scores", "N=131072 codes per key", kc.pq_topc_case(64, 131072), scores,
             codes_per_key),
            ("pq_scores", "N=131072 codes per subspace", kc.pq_topc_case(64, 131072), scores,
             codes_per_subspace),
            ("topk", "N=262144", kc.topk_case(64, 262144, 2048), op_of("triton_fused"), None),
            ("topk", "N=131072", kc.topk_case(64, 131072, 2048), op_of("triton_fused"), None),
            ("index_scores", "C=2048", kc.index_scores_case(64, c=2048), op_of("triton_fp8"),
             None),
            ("index_scores", "C=1024", kc.index_scores_case(64, c=1024), op_of("triton_fp8"),
             None)]
    # the score kernel's gather lowerings and tiles at N 131072: (label, decode, precision,
    # launch, transform). smem_lanes: lane l at word l of one key (codes read one a thread),
    # row-major book, no bank conflict whatever the codes (ptxas: 234 registers bf16, 168
    # fp8; no spills). BN 512: the book re-staged half as often a key (244 registers bf16, no
    # spills; 255 and 4 spilled bytes fp8).
    for label, decode, precision, launch, transform in (
            ("smem_linear", "smem_linear", "bf16", {}, None),
            ("smem_linear zero", "smem_linear", "bf16", {}, zero_codes),
            ("shuffle", "shuffle", "bf16", {}, None),
            ("fp8", "smem", "fp8", {}, None),
            ("fp8 zero codes", "smem", "fp8", {}, zero_codes),
            ("fp8 smem_linear", "smem_linear", "fp8", {}, None),
            ("smem_lanes", "smem_lanes", "bf16", {}, None),
            ("fp8 smem_lanes", "smem_lanes", "fp8", {}, None),
            ("BN 512", "smem", "bf16", dict(block_n=512, steps=4), None),
            ("fp8 BN 512", "smem", "fp8", dict(block_n=512, steps=4), None)):
        out.append(("pq_scores", f"N=131072 {label}", kc.pq_topc_case(64, 131072),
                    pq_scores("jax_triton", decode, precision, **launch), transform))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernel_ablation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=250.0,
                    help="start no new round after this many seconds")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--only", default=None,
                    help="run only the variants whose 'op variant' contains this text")
    args = ap.parse_args()
    start = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets_n, repeats = (2, 2) if args.dry else (4, 10)
    todo = [v for v in variants(args.dry) if args.only is None or args.only in f"{v[0]} {v[1]}"]
    if not todo:
        raise SystemExit(f"--only {args.only!r} matches no variant")
    inputs = {}
    for op, label, case, _, transform in todo:
        sets = [case.make(jax.random.key(i)) for i in range(sets_n)]
        inputs[(op, label)] = [transform(s) if transform else s for s in sets]
    records = {(op, label): dict(op=op, variant=label, params=case.params, ms=[])
               for op, label, case, _, _ in todo}
    for r in range(args.rounds):
        if time.perf_counter() - start > args.budget_s:
            print(f"budget: {args.rounds - r} rounds not run")
            break
        for op, label, case, fn, _ in todo:
            rec = records[(op, label)]
            try:
                sec = program_time(lambda *a, c=case, f=fn: f(c, *a), inputs[(op, label)],
                                   repeats=repeats)
                rec["ms"].append(sec * 1e3)
            except Exception as err:  # report it and go on with the other variants
                rec["error"] = f"{type(err).__name__}: {err}"[:300]
            print(f"round {r}: {op:16s} {label:28s} "
                  f"{rec['ms'][-1] if rec['ms'] and 'error' not in rec else float('nan'):9.4f} ms"
                  + (f"  {rec['error']}" if "error" in rec else ""), flush=True)
            (out / "kernel_ablation.json").write_text(json.dumps(dict(
                device=jax.devices()[0].device_kind, jax=jax.__version__, dry=args.dry,
                records=list(records.values())), indent=1))
    print(f"\n{'op':16s} {'variant':28s} {'median ms':>10s} {'min':>8s} {'max':>8s}")
    for rec in records.values():
        ms = rec["ms"] or [float("nan")]
        print(f"{rec['op']:16s} {rec['variant']:28s} {np.median(ms):10.4f} {min(ms):8.4f} "
              f"{max(ms):8.4f}")
    print(f"wrote {out / 'kernel_ablation.json'}")


if __name__ == "__main__":
    main()
