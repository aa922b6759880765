"""Shared-memory instructions of the jax-triton pq score kernel, from its PTX, on a CPU (issue 16).

    PYTHONPATH=<triton 3.6 site> python benchmarks/pq_ptx_census.py [--out results/pq_ptx_census]

Compiles ``pallas_kernels.pq_topc.jax_triton``'s score kernel for sm_90 at the target shape
(H 64, D 128, M 32 subspaces of 4 dims, K 256, N 131072), bf16 and fp8 books, for each
launch variant below and
counts, per thread, its loads and stores (shared and global) by width, ldmatrix and wgmma (static
counts of the whole kernel: the tile loop appears once in the PTX, so its instructions count
once per tile of BN keys; the prologue's are there too: at the default launch its 32
st.shared.b16 stage q^T for the dot, before the loop), and, where
triton's bundled ptxas is present, the registers and spill bytes ptxas reports for sm_90a.
Counts, not timings: they say where shared-memory traffic comes from (the book re-staged per
tile, the gather, the relay to the dot's operand layout); the GPU's counters say what it costs
(`benchmarks/kernel_ncu_gpu.sh`). Needs the triton package (no GPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from pallas_ptx import census, ptxas_resources  # benchmarks/pallas_ptx.py

from pallas_kernels.pq_topc import jax_triton as jt

VARIANTS = {"default (BN 256, 8 warps; codes one a thread)": jt.Params(),
            "row-major book (smem_linear)": jt.Params(decode="smem_linear"),
            "codes one a thread (smem_lanes)": jt.Params(decode="smem_lanes"),
            "BN 512, 4 steps": jt.Params(block_n=512, steps=4),
            "BN 512, 4 steps, 16 warps": jt.Params(block_n=512, steps=4, num_warps=16),
            "BN 128, 16 steps, 4 warps": jt.Params(block_n=128, steps=16, num_warps=4),
            "codes prefetched": jt.Params(prefetch=True),
            "book per tile": jt.Params(book_per_tile=True),
            "prefetch + book per tile": jt.Params(prefetch=True, book_per_tile=True),
            "BN 128, 16 steps, prefetch + book per tile": jt.Params(
                block_n=128, steps=16, prefetch=True, book_per_tile=True),
            "16 warps": jt.Params(num_warps=16),
            "16 warps, prefetch + book per tile": jt.Params(num_warps=16, prefetch=True,
                                                            book_per_tile=True),
            "BN 128, 16 steps, book per tile (fp8's default in session 37)": jt.Params(
                block_n=128, steps=16, book_per_tile=True),
            "BN 128, 16 steps, 4 warps, book per tile (fp8's default)": jt.FP8_PARAMS,
            "fp8's default, keys as the dot's B operand": jt.Params(
                block_n=128, steps=16, book_per_tile=True, keys_as_b=True),
            "keys as the dot's B operand": jt.Params(keys_as_b=True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/pq_ptx_census")
    args = ap.parse_args(argv)
    import triton

    records = []
    for precision in ("bf16", "fp8"):
        lay = jt.layout(64, 32, 256, 4, fp8=precision == "fp8")
        for name, params in VARIANTS.items():
            ptx = jt.compile_ptx(lay, 131072, params)
            rec = dict(variant=name, precision=precision, block_n=params.block_n,
                       num_warps=params.num_warps, decode=params.decode,
                       per_thread_per_tile=census(ptx), ptxas=ptxas_resources(ptx))
            records.append(rec)
            print(f"{precision} {name}: {rec['per_thread_per_tile']}  ptxas: {rec['ptxas']}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"shape": dict(H=64, D=128, M=32, K=256, N=131072), "arch": "sm_90",
         "triton": triton.__version__, "records": records}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
