"""A Pallas-Triton kernel compiled for sm_90 on a CPU: its PTX instruction census and ptxas's
registers and spills (issue 16's CPU-side checks; no GPU needed).

    PYTHONPATH=<triton 3.6 site>:$PWD python benchmarks/pallas_ptx.py [--out results/pallas_ptx]

Lowers each kernel below for CUDA (``pallas_kernels.common.lower_for_cuda``), takes the Triton
IR that Pallas embeds in the custom call (MLIR bytecode), prints it as text through jax's MLIR
bindings with the Triton dialect (``jax._src.lib``: internal, a jax upgrade may break this
script, not the kernels), compiles it with the triton package for sm_90 (num_warps and
num_stages as the kernel's defaults) and runs triton's bundled ptxas for sm_90a. Counts, not
timings: whether the dots became wgmma, what goes through shared memory, register pressure,
and (where triton bundles nvdisasm) each loop's SASS instructions a trip (``sass_loops``)
and the kernel's static SASS instruction count (``sass_instructions``).
Sets (--set): index_logits (default) at a V4 prefill tile (1024 queries x 64 heads x 128,
32768 keys); index_scores: the decode indexer at 512K (N 131104, 64 heads x 128, pages of
64), contiguous (``index_scores``) and paged (``index_scores_paged``), each with f32 q (two
bf16 dots) and fp8 x fp8 (``fp8=True``), at the launch ``default_config`` gives N; fp8: every
kernel with e4m3 x e4m3 dots (``_fp8_kernels``), which should show ``wgmma ... e4m3.e4m3``;
attention: sparse_attention at issue 16's shape (``_attention_kernels``); topk: the fused
top-k's select and finish kernels (``_topk_kernels``).
The IR goes through the TTIR stage's passes first (``pallas_kernels.ptx.ttir_passes``, as XLA
does on the GPU; before session 43 this script skipped them, which changed registers and
spills, e.g. sparse_attention's ~1.2 KB of spills that the GPU's kernel does not have).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.index_logits import index_logits
from pallas_kernels.index_logits.triton import default_config, index_logits_triton
from pallas_kernels.ptx import compile_sm90, triton_ir_text

S = jax.ShapeDtypeStruct
IL_SPECS = tuple(S(shape, jnp.float32) for shape in ((1024, 64, 128), (1024, 64), (32768, 128)))


def _index_logits_variant(**launch):
    """index_logits' Triton kernel with launch parameters changed from the default."""
    return (functools.partial(index_logits_triton, **launch), IL_SPECS,
            default_config(1024, 64, 32768) | launch)


def _index_scores_kernels() -> dict:
    """The decode indexer's kernels at 512K (2 requests: a program's code does not depend on
    B), contiguous and paged, f32 q and fp8 x fp8."""
    from pallas_kernels.index_scores.paged import index_scores_paged_triton
    from pallas_kernels.index_scores.triton import index_scores_triton, resolve_config

    b, h, d, n, page, tail = 2, 64, 128, 131104, 64, 64
    rows = b * -(-n // page) * page
    f32, e4m3, i32 = jnp.float32, jnp.float8_e4m3fn, jnp.int32
    _, _, warps = resolve_config(b, h, n, None, None, None)
    cfg = {"num_warps": warps, "num_stages": 3}  # Pallas-Triton's default on CUDA (None here)
    q = (S((b, h, d), f32), S((b, h), f32))
    contiguous = (*q, S((b, n, d), e4m3), S((b, n, 1), f32), S((b, n), bool))
    paged = (*q, S((rows, d), e4m3), S((rows, 1), f32), S((b, rows // b // page), i32),
             S((b, tail, d), e4m3), S((b, tail, 1), f32), S((b,), i32), S((b, n), bool))
    out = {}
    for fp8 in (False, True):
        arith = "fp8 x fp8" if fp8 else "f32 q"
        out[f"index_scores {arith}"] = (functools.partial(index_scores_triton, fp8=fp8),
                                        contiguous, cfg)
        out[f"index_scores_paged {arith}"] = (
            functools.partial(index_scores_paged_triton, page=page, fp8=fp8), paged, cfg)
    return out


def _fp8_kernels() -> dict:
    """Every Pallas-Triton kernel with e4m3 x e4m3 dots (``pallas_kernels.fp8_dot``): the
    decode indexer at 512K (contiguous and paged, as the index_scores set), LeanSparse's
    rescoring with its top-512 fused (C 2048 candidates), and the Pallas coarse PQ pass at
    precision fp8 (N 131104, 32 subspaces of 256 centroids)."""
    from pallas_kernels.index_scores.topk_fused import index_topk_triton
    from pallas_kernels.pq_topc.triton import _params_for, coarse_scores_triton

    out = {k: v for k, v in _index_scores_kernels().items() if "fp8" in k}
    b, h, d, c, n, m = 2, 64, 128, 2048, 131104, 32
    f32, e4m3 = jnp.float32, jnp.float8_e4m3fn
    out["index_topk fp8 (fused top-512)"] = (
        functools.partial(index_topk_triton, k=512),
        (S((b, h, d), f32), S((b, h), f32), S((b, c, d), e4m3), S((b, c, 1), f32),
         S((b, c), bool)), {"num_warps": 8, "num_stages": 3})
    p = _params_for(h, d, m, 256, n, None)
    out["pq coarse_scores fp8"] = (
        functools.partial(coarse_scores_triton, precision="fp8"),
        (S((b, h, d), f32), S((b, h), f32), S((b, n, m), jnp.uint8), S((m, 256, d // m), f32),
         S((b,), jnp.int32)), {"num_warps": p.num_warps, "num_stages": p.num_stages})
    return out


def _attention_kernels() -> dict:
    """sparse_attention's Triton kernel at issue 16's shape (B 64, 64 heads, D 512, K 512, W
    128, bf16 rows) at its default launch, the launches sessions 24-39 timed and the in-kernel
    combine (session 51)."""
    from pallas_kernels.sparse_attention.triton import default_config, sparse_attention_triton

    s, h, d, k, w, r = 64, 64, 512, 512, 128, 4096
    bf16 = jnp.bfloat16
    specs = (S((s, h, d), bf16), S((s, r, d), bf16), S((s, k), jnp.int32), S((s, w, d), bf16),
             S((s, w), bool), S((h,), jnp.float32))
    out = {}
    for name, launch in (("default", {}), ("2 stages", dict(num_stages=2)),
                         ("BK 64, 2 stages", dict(block_k=64, num_stages=2)),
                         ("BK 16", dict(block_k=16)),
                         ("fused combine", dict(fused_combine=True))):
        cfg = default_config(s, h, d, k, w, 2 * d, **{
            key: v for key, v in launch.items() if key != "fused_combine"})
        out[f"sparse_attention {name}"] = (
            functools.partial(sparse_attention_triton, **launch), specs,
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return out


def _topk_kernels() -> dict:
    """topk "triton_fused"'s select kernel (with a floor hint: the one launch ahead of the
    finish) and finish kernel at issue 16's 64 x 262144, k 2048: select's compare "float" /
    "keys" and chunk 4096 (the default before session 47), the finish with and without the
    early stop (session 45) and its session 48 forms, and the threshold launch (the first of
    its select_call's two kernels; the census reads the first) by bits and by thirds."""
    from pallas_kernels.topk import fused

    b, n, k = 64, 262144, 2048
    out = {}
    for name, tun in (("float (default)", {}), ("keys", dict(compare="keys")),
                      ("float, chunk 4096", dict(chunk=4096))):
        cfg = fused.fused_config(n, k, interpret=False, **tun)
        out[f"topk select {name}"] = (
            functools.partial(fused.select_call, cfg=cfg),
            (S((b, n), jnp.float32), S((b, 1), jnp.int32), S((b,), jnp.float32)),
            {"num_warps": cfg.select_warps, "num_stages": 1})
    for name, tun in (("early stop (default)", {}), ("32 steps", dict(stop_early=False)),
                      ("prefix sums of 64 rows", dict(finish_scan_rows=64)),
                      ("2 programs a row, 64 rows, skip_ties",
                       dict(finish_programs=2, finish_scan_rows=64, skip_ties=True)),
                      ("2 programs a row, 64 rows, skip_ties, thirds",
                       dict(finish_programs=2, finish_scan_rows=64, skip_ties=True,
                            search="thirds"))):
        cfg = fused.fused_config(n, k, interpret=False, **tun)
        out[f"topk finish {name}"] = (
            functools.partial(fused.finish_call, cfg=cfg),
            (S((b, 1), jnp.int32), S((b, 16, 2), jnp.int32), S((b, cfg.cr, 2), jnp.int32),
             S((b, n), jnp.float32)),
            {"num_warps": cfg.finish_warps, "num_stages": 1})
    for name, search in (("bits (default)", "bits"), ("thirds", "thirds")):
        cfg = fused.fused_config(n, k, interpret=False, threshold_kernel=True, search=search)
        out[f"topk threshold {name}"] = (  # select_call's first launch
            functools.partial(fused.select_call, floor=None, cfg=cfg),
            (S((b, n), jnp.float32), S((b, 1), jnp.int32)),
            {"num_warps": cfg.finish_warps, "num_stages": 1})
    return out


SETS = {
    "index_logits": lambda: {
        "index_logits": (functools.partial(index_logits, implementation="triton"), IL_SPECS,
                         default_config(1024, 64, 32768)),
        "index_logits BT 2": _index_logits_variant(block_t=2),
        "index_logits BT 8, 8 warps": _index_logits_variant(block_t=8, num_warps=8)},
    "index_scores": _index_scores_kernels,
    "fp8": _fp8_kernels,
    "attention": _attention_kernels,
    "topk": _topk_kernels,
}


def sass_loops(sass: str) -> list[dict]:
    """The loops of nvdisasm's SASS (``-c``): each backward branch to a label and the
    instructions from that label to it, as {"instructions": n, "ops": {opcode: count}} (an
    opcode without its predicate and modifiers); a nested loop is counted again inside its
    outer one. A static count of one trip, not a timing."""
    labels, ins = {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            labels[m[1]] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            ins.append(m[1])
    loops = []
    for i, op in enumerate(ins):
        m = re.search(r"BRA\s+(?:!?U?P\w+,\s*)?`\(\.(L_x_\d+)\)", op)  # (@P BRA P5, `(...))
        if m and labels.get(m[1], i) < i:  # (a label's branch to itself ends the kernel)
            body = ins[labels[m[1]]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", o).split()[0].split(".")[0]
                                      for o in body)
            loops.append({"instructions": len(body), "ops": dict(ops.most_common())})
    return loops


def ptxas_run(ptx: str) -> tuple[str, str | None] | None:
    """PTX compiled by triton's bundled ptxas for sm_90a: (ptxas -v's log, nvdisasm's SASS of
    the cubin, or None without nvdisasm); None without ptxas."""
    import triton

    bin_dir = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"
    if not (bin_dir / "ptxas").exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = pathlib.Path(tmp) / "k.ptx", pathlib.Path(tmp) / "k.cubin"
        src.write_text(ptx)
        log = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", str(src), "-o",
                              str(cubin)], capture_output=True, text=True, check=True).stderr
        if not (bin_dir / "nvdisasm").exists():
            return log, None
        return log, subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)],
                                   capture_output=True, text=True, check=True).stdout


def resources(log: str) -> dict:
    """Registers and spill bytes from ptxas -v's log."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(regs[1]) if regs else None,
            "spill_store_bytes": int(spills[1]) if spills else None,
            "spill_load_bytes": int(spills[2]) if spills else None}


def ptxas_resources(ptx: str) -> dict | None:
    """Registers and spill bytes from triton's bundled ptxas for sm_90a (None without it)."""
    run = ptxas_run(ptx)
    return None if run is None else resources(run[0])


def census(ptx: str) -> dict:
    """{instruction: static count} of PTX's loads, stores, ldmatrix / stmatrix and MMAs."""
    counts: collections.Counter = collections.Counter()
    for line in ptx.splitlines():
        words = line.split()
        if not words or words[0][0] in ".{}/$":
            continue
        op = words[1] if words[0].startswith("@") else words[0]
        if op.startswith(("ld.", "st.", "ldmatrix", "stmatrix", "wgmma.mma_async", "mma.")):
            counts[op.replace(".sync.aligned", "")] += 1
    return dict(sorted(counts.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/pallas_ptx")
    ap.add_argument("--set", default="index_logits", choices=tuple(SETS))
    args = ap.parse_args(argv)
    import triton

    records = []
    for name, (fn, specs, cfg) in SETS[args.set]().items():
        ptx = compile_sm90(triton_ir_text(common.lower_for_cuda(fn, *specs)),
                           cfg["num_warps"], cfg["num_stages"])
        shapes = [[list(x.shape), jnp.dtype(x.dtype).name] for x in specs]
        log, sass = ptxas_run(ptx) or (None, None)
        rec = dict(kernel=name, shapes=shapes, config=cfg, instructions=census(ptx),
                   ptxas=None if log is None else resources(log),
                   sass_loops=None if sass is None else sass_loops(sass),
                   sass_instructions=None if sass is None else len(re.findall(
                       r"^\s*/\*[0-9a-f]+\*/\s+\S", sass, re.M)))
        records.append(rec)
        loops = ", ".join(f"{lp['instructions']}" for lp in rec["sass_loops"] or [])
        print(f"{name}: ptxas {rec['ptxas']}; SASS loops (instructions a trip): {loops}\n"
              f"  {rec['instructions']}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"arch": "sm_90", "triton": triton.__version__, "jax": jax.__version__,
         "set": args.set, "records": records}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
