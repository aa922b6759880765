"""Admission straight from the layer-streamed prefill, and prefix reuse, at V4 shapes (issue 13
deliverable 1, issue 14 deliverable 3).

Run on the GPU machine (H200, jax 0.11.2), time-limited, resumable (cells already in the JSON
are skipped, so a second call continues the grid):
    python benchmarks/prefill_host_gpu.py --out $OUT --budget-s 540            # 128K, 512K
    python benchmarks/prefill_host_gpu.py --out $OUT --budget-s 540 --one-m    # adds 1M
One short slot (~70 s wall with compiles): --quick runs the cells in one process (compiles
shared, params drawn once), without decode steps (the first sampled token is compared) and
without step 4; the JSON is rewritten after every step, so a kill keeps what was measured:
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 68 python benchmarks/prefill_host_gpu.py \
        --quick --contexts 131072 --methods leansparse,hisparse,adaptive --budget-s 55
CPU smoke (tiny model, any backend; checks the script, ~2-4 min on 2 cores):
    JAX_PLATFORMS=cpu python benchmarks/prefill_host_gpu.py --smoke --out /tmp/phg

Model: the v4_flash preset's 4-layer slice (swa, csa, hca, csa), random weights,
``matmul_precision="bf16"``, implementation "triton"; HiSparse B = 4096, LeanSparse C = 2048
with a 4K key cache and random codebooks, page size 64, prefill chunk 4096, one slot,
``CacheConfig.streamed_prefill=True``; max_len = context + suffix + 64.

One cell = one (context, method), run in its own process (``peak_bytes_in_use`` only grows in
a process, so each cell starts from zero):
  1. warm-up: a 2-chunk streamed admission, a detach and a prefix admission (compiles).
  2. streamed: ``Engine.admit`` of ``context`` random tokens, each layer admitted as the stream
     finishes it: ``prefill_s``; device bytes beyond those before it (params + the decode
     state): ``sampled_extra_bytes`` (bytes_in_use after every layer, the buffers held) and
     ``peak_extra_bytes`` (peak_bytes_in_use - bytes before; includes the kernels' scratch).
  3. prefix reuse: ``detach`` (``detach_s``), then ``admit(prompt + suffix, prefix=...)``
     (``reuse_s``: the suffix streamed over the host-resident prefix) vs a fresh engine's
     streamed admission of the same prompt from scratch (``full_s``); the greedy tokens of 4
     decode steps after each (``reuse_tokens_equal``; the prefix is chunk-aligned, so the
     expected answer is True).
  4. today's path: ``steps.prefill`` (every layer's caches on the device) + ``state.admit``:
     ``monolithic_prefill_s`` (after a warm-up on a short prompt) and its
     ``monolithic_peak_extra_bytes`` (measured last: it is the larger).
Accounting beside them (``memory.accounting.admission_device_bytes``): ``decode_bytes`` (the
slot, preallocated at max_len; ``decode_bytes_at_context``: at the context alone),
``layer_buffers_bytes`` (max_l S_l + S_{l+1}), ``resident_state_bytes`` (sum_l S_l),
``streamed_peak_formula`` = decode + two layer buffers.
Writes prefill_host_gpu.json (a list of cell records) under --out after every cell; prints a
table last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

METHODS = ("resident", "hisparse", "leansparse", "adaptive")


def settings(smoke: bool) -> dict:
    if smoke:
        return dict(contexts=(128, 256), chunk=32, suffix=32, page=8, hot=32, lean=(64, 64),
                    implementation="xla")
    return dict(contexts=(131072, 524288), chunk=4096, suffix=4096, page=64, hot=4096,
                lean=(2048, 4096), implementation="triton")


def model(smoke: bool, tokens: int):
    from lsparse_jax.model import preset
    from lsparse_jax.model.presets import fit_max_len

    pattern = ("swa", "csa", "hca", "csa")
    if smoke:
        cfg = preset("tiny", layer_pattern=pattern, hca_ratio=16)
    else:
        cfg = preset("v4_flash", layer_pattern=pattern, matmul_precision="bf16")
    return fit_max_len(cfg, tokens)


def random_codebooks(cfg, subspace_dim: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {i: rng.normal(size=(cfg.indexer.head_dim // subspace_dim, 256, subspace_dim))
            .astype(np.float32) for i, k in enumerate(cfg.layer_pattern) if k == "csa"}


def random_params(cfg, seed: int = 0):
    """Random params with init_params' tree, drawn on the device leaf by leaf (no eager forward
    pass, as ``init_params`` runs): norms 1, sinks and biases 0, embedding N(0, 1), kernels
    N(0, 1/fan_in) (prefill_stream_gpu.py's rules)."""
    import functools

    import jax
    import jax.numpy as jnp

    from lsparse_jax.model import init_params

    shapes = jax.eval_shape(functools.partial(init_params, cfg, seed))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, (path, leaf) in zip(keys, leaves):
        name = path[-1].key
        if name == "scale":
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        elif name in ("sink", "pos_bias") or name == "bias":
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            std = 1.0 if name == "embedding" else leaf.shape[0] ** -0.5
            out.append((jax.random.normal(key, leaf.shape, jnp.float32) * std)
                       .astype(leaf.dtype))
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, out))


_PARAMS: dict = {}  # (smoke, max_len) -> params, shared by the cells of one process


def run_cell(spec: dict, save=None, over=lambda: False) -> dict:
    """One (context, method) cell (steps 1-4 of the module docstring). ``save(record)`` after
    every step (a killed run keeps what it measured); ``over()`` True: stop before the next
    step. ``spec["quick"]``: no decode steps (the first sampled token is compared) and no
    step 4."""
    import jax
    import numpy as np

    from lsparse_jax.config import (
        CacheConfig,
        EngineConfig,
        LeanSparseConfig,
        SamplingConfig,
        method_storage,
    )
    from lsparse_jax.memory.accounting import admission_device_bytes, request_bytes
    from lsparse_jax.serving.engine import Engine
    from lsparse_jax.serving.request import Request
    from lsparse_jax.serving.steps import prefill

    s, method, context = settings(spec["smoke"]), spec["method"], spec["context"]
    chunk, suffix, quick = s["chunk"], s["suffix"], spec.get("quick", False)
    save = save or (lambda rec: None)
    cfg = model(spec["smoke"], context + suffix + 64)
    dev = jax.devices()[0]

    def stats():
        got = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        return (got or {}).get("bytes_in_use"), (got or {}).get("peak_bytes_in_use")

    hot = s["hot"] if method_storage(method).kv_on_host else None
    optional = None
    if method == "adaptive":  # half the prompt's complete pages, as scale.py's batch of one
        optional = max(1, context // cfg.csa_ratio // s["page"] // 2)
    cache = CacheConfig(1, chunk, hot, s["page"], streamed_prefill=True,
                        optional_pages=optional)
    lean = LeanSparseConfig(s["lean"][0], 1.0, s["lean"][1])
    config = EngineConfig(model=cfg, cache=cache, sampling=SamplingConfig(0.0, 0),
                          method=method, leansparse=lean, implementation=s["implementation"])
    t0 = time.perf_counter()
    key = (spec["smoke"], cfg.max_len)
    if key not in _PARAMS:
        _PARAMS.clear()
        _PARAMS[key] = random_params(cfg, 0)
    params = _PARAMS[key]
    books = random_codebooks(cfg, lean.pq_subspace_dim, 0) if method_storage(
        method).keys_on_host else None
    rng = np.random.default_rng(context)
    prompt = rng.integers(0, cfg.vocab_size, context).astype(np.int32)
    turn = rng.integers(0, cfg.vocab_size, suffix).astype(np.int32)
    acc = admission_device_bytes(config)
    rec = dict(spec, max_len=cfg.max_len, chunk=chunk, suffix=suffix, device=str(dev),
               jax=jax.__version__, decode_bytes=acc["decode"],
               decode_bytes_at_context=request_bytes(config, context).gpu_total,
               layer_buffers_bytes=acc["layer_buffers"],
               resident_state_bytes=acc["resident_state"],
               streamed_peak_formula=acc["streamed_peak"],
               monolithic_peak_formula=acc["monolithic_peak"])
    rec["params_s"] = time.perf_counter() - t0

    def greedy(engine, n=4):
        if quick:  # the token sampled at admission (no decode step to compile)
            return [engine.requests[0].tokens[0]]
        return [int(engine.step().tokens[0]) for _ in range(n)]

    # 1. warm-up (compiles the stream, the per-layer admissions, detach and prefix loads)
    t0 = time.perf_counter()
    engine = Engine(config, params, books)
    short = prompt[:chunk if quick else 2 * chunk]
    engine.admit(Request(short, max_new_tokens=8))
    warm_prefix = engine.detach(0)
    engine.admit(Request(np.concatenate([short, turn[:chunk]]), max_new_tokens=8),
                 prefix=warm_prefix)
    greedy(engine, 1)
    engine.release(0)
    jax.block_until_ready(engine.state)
    rec["warmup_s"] = time.perf_counter() - t0
    save(rec)
    if over():
        return rec

    # 2. the streamed admission of the whole context
    base, _ = stats()
    sampled = []
    t0 = time.perf_counter()
    engine.admit(Request(prompt, max_new_tokens=8),
                 on_layer=lambda e: sampled.append(stats()[0]))
    rec["prefill_s"] = time.perf_counter() - t0
    used, peak = stats()
    if base is not None:
        rec["bytes_before"] = base
        rec["sampled_extra_bytes"] = max(sampled) - base
        rec["peak_extra_bytes"] = peak - base
        rec["bytes_after_admission"] = used
    save(rec)
    if over():
        return rec

    # 3. prefix reuse vs a full streamed prefill of the extended prompt
    t0 = time.perf_counter()
    prefix = engine.detach(0)
    rec["detach_s"] = time.perf_counter() - t0
    rec["prefix_tokens"], rec["prefix_host_bytes"] = prefix.length, prefix.host_bytes
    extended = np.concatenate([prefix.tokens, turn])
    t0 = time.perf_counter()
    engine.admit(Request(extended, max_new_tokens=8), prefix=prefix)
    rec["reuse_s"] = time.perf_counter() - t0
    reused = greedy(engine)
    engine.release(0)
    save(rec)
    if over():
        return rec
    t0 = time.perf_counter()
    engine.admit(Request(extended, max_new_tokens=8))
    rec["full_s"] = time.perf_counter() - t0
    rec["reuse_tokens_equal"] = reused == greedy(engine)
    rec["reuse_speedup"] = rec["full_s"] / rec["reuse_s"]
    engine.release(0)
    save(rec)

    # 4. today's path: all layers on the device, then state.admit (measured last: larger)
    if spec.get("no_monolithic") or quick or over():
        return rec
    t0 = time.perf_counter()
    engine.admit(Request(short, max_new_tokens=8),
                 prefilled=prefill(params, cfg, short, chunk))
    engine.release(0)
    jax.block_until_ready(engine.state)
    rec["monolithic_warmup_s"] = time.perf_counter() - t0
    base, _ = stats()
    t0 = time.perf_counter()
    engine.admit(Request(prompt, max_new_tokens=8), prefilled=prefill(params, cfg, prompt, chunk))
    rec["monolithic_prefill_s"] = time.perf_counter() - t0
    if base is not None:
        rec["monolithic_peak_extra_bytes"] = stats()[1] - base
    save(rec)
    return rec


def table(records) -> str:
    mb = 2**20
    head = (f"{'method':<11}{'context':>9}{'prefill s':>10}{'mono s':>8}{'held MB':>9}"
            f"{'peak MB':>9}{'mono MB':>9}{'2buf MB':>9}{'decode MB':>10}{'reuse s':>8}"
            f"{'full s':>7}{'equal':>6}")
    lines = [head]
    for r in records:
        if "error" in r:
            lines.append(f"{r['method']:<11}{r['context']:>9}  error: {r['error'][:80]}")
            continue
        def g(key, r=r):
            return f"{r[key] / mb:.1f}" if r.get(key) is not None else "-"

        def t(key, r=r):
            return f"{r[key]:.2f}" if r.get(key) is not None else "-"

        lines.append(
            f"{r['method']:<11}{r['context']:>9}{t('prefill_s'):>10}"
            f"{t('monolithic_prefill_s'):>8}{g('sampled_extra_bytes'):>9}"
            f"{g('peak_extra_bytes'):>9}{g('monolithic_peak_extra_bytes'):>9}"
            f"{g('layer_buffers_bytes'):>9}{g('decode_bytes'):>10}{t('reuse_s'):>8}"
            f"{t('full_s'):>7}{str(r.get('reuse_tokens_equal', '-')):>6}")
    lines.append("held: device bytes_in_use beyond those before the admission, sampled after "
                 "every layer (the buffers); peak: peak_bytes_in_use - before (with scratch); "
                 "mono: today's path; 2buf: two layer buffers (accounting); reuse/full: "
                 "prefix + suffix admission vs the whole prompt from scratch")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/prefill_host"))
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no cell after this many seconds; a cell is killed at it")
    ap.add_argument("--contexts", default=None, help="comma-separated (default 131072,524288)")
    ap.add_argument("--one-m", action="store_true", help="add 1048576 to the contexts")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-monolithic", action="store_true",
                    help="skip step 4 (today's path), to save a full prefill per cell")
    ap.add_argument("--quick", action="store_true",
                    help="every cell in this process (compiles shared), no decode steps (the "
                         "first sampled token is compared), no step 4; peak_extra_bytes is "
                         "then exact for the first cell only (the process peak only grows)")
    ap.add_argument("--smoke", action="store_true", help="tiny model (checks the script)")
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # internal: one cell
    args = ap.parse_args()
    if args.cell is not None:
        print("CELL " + json.dumps(run_cell(json.loads(args.cell))), flush=True)
        return
    t_start = time.perf_counter()
    s = settings(args.smoke)
    contexts = (tuple(int(c) for c in args.contexts.split(",")) if args.contexts
                else s["contexts"]) + ((1048576,) if args.one_m else ())
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed {list(METHODS)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prefill_host_gpu.json"
    records = json.loads(path.read_text()) if path.exists() else []
    done = {(r["context"], r["method"]) for r in records if "error" not in r}
    records = [r for r in records if "error" not in r]
    for context in contexts:
        for method in methods:
            if (context, method) in done:
                continue
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < (20 if args.quick else 30):
                print(f"budget: skipping {method} at {context} and after", flush=True)
                break
            spec = {"context": context, "method": method, "smoke": args.smoke,
                    "no_monolithic": args.no_monolithic, "quick": args.quick}
            if args.quick:
                def save(rec):
                    path.write_text(json.dumps(records + [rec], indent=2))

                def over():
                    return time.perf_counter() - t_start > args.budget_s

                try:
                    rec = run_cell(spec, save, over)
                except Exception as err:  # noqa: BLE001  (recorded; the grid goes on)
                    rec = dict(spec, error=f"{type(err).__name__}: {str(err)[:300]}")
                records.append(rec)
                print(json.dumps(rec), flush=True)
                path.write_text(json.dumps(records, indent=2))
                continue
            try:
                proc = subprocess.run([sys.executable, __file__, "--cell", json.dumps(spec)],
                                      capture_output=True, text=True, timeout=left)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("CELL ")),
                            None)
                if line is None:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    rec = dict(spec, error=f"rc={proc.returncode}: {' | '.join(tail)[:400]}")
                else:
                    rec = json.loads(line[5:])
            except subprocess.TimeoutExpired:
                rec = dict(spec, error=f"killed at the budget ({left:.0f} s left)")
            records.append(rec)
            print(json.dumps(rec), flush=True)
            path.write_text(json.dumps(records, indent=2))
        else:
            continue
        break
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    print(table(records))


if __name__ == "__main__":
    main()
