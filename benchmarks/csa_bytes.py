"""Device bytes per request and per CSA layer, LeanSparse vs HiSparse (issue 13 target: >= 3x
per CSA layer at 512K), from the byte accounting (``memory.accounting.request_bytes``, byte-exact
against the allocation in tests/test_accounting.py and tests/test_device_pool.py) with the
caches the LeanSparse paper evaluates (section 6.1: HiSparse a 4K-entry KV buffer; LeanSparse
2K KV entries and 4K indexer keys per CSA layer, 32-byte PQ codes) and device pools of 64-row
pages, on the full 43-layer V4-Flash preset. CPU, instant.

Run: python benchmarks/csa_bytes.py [--out results/csa_bytes] [--pq-subspace-dim 4]
Writes results.json (one record per layout x context) and prints a table. --pq-subspace-dim 2
prices 64-byte codes (the accuracy study's _pq2 remedy at V4's 128-dim keys).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from experiments.capacity import PAPER_HOT_ROWS, engine_for
from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.memory.accounting import Layout, request_bytes
from lsparse_jax.model import preset

PAPER_LEAN = LeanSparseConfig(num_candidates=2048, key_cache_rows=4096, miss_filter_offset=1.0)


def records(contexts=(204800, 524288, 972800, 1048576), lean=PAPER_LEAN):
    """One record per (layout, context): CSA-layer and whole-request bytes of both methods."""
    out = []
    for kv_dtype in ("fp8_v4", "bf16"):
        model = preset("v4_flash", kv_dtype=kv_dtype)
        layouts = {"ours": Layout.ours(model)}
        if kv_dtype == "fp8_v4":
            layouts["v4_serving"] = Layout.v4_serving()
        csa = model.layer_pattern.index("csa")
        for name, lay in layouts.items():
            for ctx in contexts:
                rec = {"kv_dtype": kv_dtype, "layout": name, "context": ctx}
                for m in ("hisparse", "leansparse"):
                    engine = engine_for(model, m, PAPER_HOT_ROWS, 64, lean)
                    rb = request_bytes(engine, ctx, lay)
                    rec[f"{m}_csa_layer_bytes"] = sum(rb.per_layer[csa].values())
                    rec[f"{m}_request_bytes"] = rb.gpu_total
                rec["csa_layer_ratio"] = rec["hisparse_csa_layer_bytes"] / rec[
                    "leansparse_csa_layer_bytes"]
                rec["request_ratio"] = rec["hisparse_request_bytes"] / rec[
                    "leansparse_request_bytes"]
                out.append(rec)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/csa_bytes")
    ap.add_argument("--pq-subspace-dim", type=int, default=PAPER_LEAN.pq_subspace_dim)
    args = ap.parse_args(argv)
    lean = dataclasses.replace(PAPER_LEAN, pq_subspace_dim=args.pq_subspace_dim)
    recs = records(lean=lean)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"caches": {"hot_cache_rows": PAPER_HOT_ROWS, "key_cache_rows": 4096,
                              "page_size": 64, "model": "v4_flash (43 layers)",
                              "pq_subspace_dim": lean.pq_subspace_dim},
                   "records": recs}, f, indent=1)
    print(f"{'rows':>7} {'layout':>10} {'context':>8} {'his B/CSA':>11} {'lean B/CSA':>11} "
          f"{'ratio':>6} {'request ratio':>13}")
    for r in recs:
        print(f"{r['kv_dtype']:>7} {r['layout']:>10} {r['context']:>8} "
              f"{r['hisparse_csa_layer_bytes']:>11,} {r['leansparse_csa_layer_bytes']:>11,} "
              f"{r['csa_layer_ratio']:>6.2f} {r['request_ratio']:>13.2f}")


if __name__ == "__main__":
    main()
