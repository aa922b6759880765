"""Code size of the Mosaic GPU sparse_attention kernel, on a CPU (issue 16).

    python benchmarks/mosaic_code_size.py [--out results/mosaic_code_size]

Session 26's Nsight Compute run found the kernel's warps stalled most on `no_instruction`
(waiting for instructions to be fetched). mosaic.py issues a block's row copies as 64 unrolled
rows x 3 predicated TMA copies, at two places; ``row_loop=True`` issues them from a loop. This
lowers the kernel for CUDA at the V4-Flash shape (B 64, k 512, W 128, H 64, D 512, bf16) both
ways and counts the operations of the Mosaic GPU module (the MLIR the kernel is compiled from)
by name: all of them, the conditionals (``scf.index_switch``, one per predicated copy), the
inline assembly and the loops. Counts, not timings: whether fewer instructions make the kernel
faster is the GPU's to say (`benchmarks/sparse_attention_v2_gpu.py --only-mosaic`).
Reads the module through jax's internal MLIR bindings (``jax._src.lib.mlir``): a jax upgrade may
break this script; the kernel does not depend on it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib

import jax

from experiments.cases.sparse_attention import make_inputs
from pallas_kernels import common
from pallas_kernels.ptx import attribute_bytes
from pallas_kernels.sparse_attention.mosaic import sparse_attention_mosaic

KINDS = ("scf.index_switch", "scf.for", "llvm.inline_asm")


def op_counts(module: bytes) -> collections.Counter:
    from jax._src.lib.mlir import ir

    counts: collections.Counter = collections.Counter()

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.name
                    counts[name.split(".", 1)[1] if name.startswith("stable_") else name] += 1
                    walk(child.operation)

    with ir.Context() as ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        walk(ir.Module.parse(module).operation)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/mosaic_code_size")
    args = ap.parse_args(argv)
    shape = dict(batch=64, k=512, window=128, heads=64, dim=512, rows=2048, dtype="bfloat16")
    specs = jax.eval_shape(functools.partial(make_inputs, **shape), jax.random.key(0))
    records = []
    for row_loop in (False, True):
        text = common.lower_for_cuda(functools.partial(sparse_attention_mosaic,
                                                       row_loop=row_loop), *specs)
        counts = op_counts(attribute_bytes(text, "module"))  # the serialized Mosaic module
        records.append(dict(row_loop=row_loop, ops=sum(counts.values()),
                            **{k: counts[k] for k in KINDS}))
    print("| row_loop | ops | " + " | ".join(KINDS) + " |")
    print("|---|---:|" + "---:|" * len(KINDS))
    for r in records:
        print(f"| {r['row_loop']} | {r['ops']} | " + " | ".join(str(r[k]) for k in KINDS) + " |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"shape": shape, "jax": jax.__version__, "records": records}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
