"""Layer-streamed prefill vs monolithic prefill on the GPU (LeanSparse §4, identity 4).

Run on the GPU machine: python benchmarks/prefill_stream_gpu.py [--out DIR] [--tokens 65536]
(``--smoke`` runs a tiny model on any backend, to check the script.) Prints a table last and
writes prefill_stream_gpu.json.

Model: the tiny preset widened so that the per-layer state is large and the per-layer compute
small (a V4-like pattern: two SWA layers, then CSA/HCA pairs; KV head dim 512, so a CSA layer
holds max_len / 4 x 2 KiB of compressed KV). Params are random with init_params' shapes
(filled directly: an eager init of a wide model is slow).

Modes, each timed (median of --repeats device-synchronized runs of the whole prompt, after a
compiling warm-up on a short prompt):
  monolithic     steps.prefill: one jitted Transformer per chunk, all caches on the device
  layers/device  the streamed schedule with the state kept on the device (no transfers): what
                 the per-layer jits cost by themselves
  streamed       state in pinned_host; the next layer's load overlaps the current layer
  no overlap     the same, but every transfer is waited for before going on
Streamed times end when every layer's state is back on the host (``stream_prefix``); the final
upload of ``streamed_prefill`` (the engine's device caches) is timed separately.
Per chunk the stream moves sum_l S_l host->device (not in the first chunk: no prefix yet) and
sum_l S_l device->host. ``eff GB/s`` = bytes streamed / (mode - layers/device): the link rate
that would explain the extra time; above the link's ~48 GB/s means part of it is hidden.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import jax
import numpy as np

from lsparse_jax.config import IndexerConfig
from lsparse_jax.model import init_params, preset
from lsparse_jax.serving.prefill_stream import layer_state_bytes, stream_prefix, stream_state_bytes
from lsparse_jax.serving.steps import prefill

PCIE = 48e9  # measured pinned_host <-> device, ../shared/gpu_facts


def model_config(args):
    if args.smoke:
        return preset("tiny", max_len=args.tokens, hca_ratio=16, swa_window=8, hidden=64,
                      num_heads=2, head_dim=32, mlp_hidden=64,
                      layer_pattern=("swa", "csa", "hca", "csa"))
    pattern = ("swa", "swa") + ("csa", "hca") * args.pairs
    return preset("tiny", hidden=512, num_heads=4, head_dim=args.head_dim, rope_dim=64,
                  mlp_hidden=1024, layer_pattern=pattern, swa_window=128, csa_ratio=4,
                  hca_ratio=128, max_len=args.tokens,
                  indexer=IndexerConfig(num_heads=4, head_dim=64, top_k=256, fp8_block=64))


def random_params(cfg, seed=0):
    """Random params with init_params' tree: norms 1, sinks and biases 0, kernels N(0, 1/fan_in)."""
    shapes = jax.eval_shape(functools.partial(init_params, cfg, 0))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            return np.ones(leaf.shape, np.float32)
        if name in ("sink", "pos_bias"):
            return np.zeros(leaf.shape, np.float32)
        std = 1.0 if name == "embedding" else leaf.shape[0] ** -0.5
        return rng.standard_normal(leaf.shape, np.float32) * np.float32(std)

    return jax.device_put(jax.tree_util.tree_map_with_path(fill, shapes))


def timed(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        out = None  # free the previous result first
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def compare(got, want):
    """(bit-identical leaves, leaves, max |difference| over finite entries)."""
    same, worst = 0, 0.0
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    for a, b in leaves:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        same += bool(np.array_equal(a, b, equal_nan=True))
        both = np.isfinite(a) & np.isfinite(b)
        if (np.isfinite(a) != np.isfinite(b)).any():
            worst = float("inf")
        elif both.any():
            worst = max(worst, float(np.abs(a[both] - b[both]).max()))
    return same, len(leaves), worst


def bytes_in_use(dev):
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return None if not stats else stats.get("bytes_in_use")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=65536, help="prompt tokens (= max_len)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--pairs", type=int, default=4, help="CSA/HCA layer pairs after 2 SWA")
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model (check the script on CPU)")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.chunk = min(args.tokens, 256), min(args.chunk, 48)

    t_start = time.perf_counter()
    cfg = model_config(args)
    dev = jax.devices()[0]
    params = random_params(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, args.tokens).astype(np.int32)
    chunk, n = args.chunk, args.tokens
    num_chunks = -(-n // chunk)
    state = layer_state_bytes(cfg)
    per_chunk = sum(state)
    streamed_bytes = (2 * num_chunks - 1) * per_chunk  # D2H every chunk, H2D from the second

    def mono(toks):
        return prefill(params, cfg, toks, chunk)

    def layered(toks, **kw):
        p = stream_prefix(params, cfg, toks, chunk, **kw)
        return p.caches, p.last_logits

    modes = {"monolithic": mono,
             "layers/device": functools.partial(layered, store="device"),
             "streamed": layered,
             "no overlap": functools.partial(layered, overlap=False)}
    short = tokens[:2 * chunk + 1]
    t0 = time.perf_counter()
    for fn in modes.values():  # compile (one chunk shape, fixed max_len) on a short prompt
        jax.block_until_ready(fn(short))
    compile_s = time.perf_counter() - t0

    results = {"device": str(dev), "jax": jax.__version__, "tokens": n, "chunk": chunk,
               "layer_pattern": list(cfg.layer_pattern), "head_dim": cfg.head_dim,
               "layer_state_bytes": list(state), "bytes_per_chunk_each_way": per_chunk,
               "streamed_bytes": streamed_bytes, "compile_and_warmup_s": compile_s,
               "device_state_bytes": {"monolithic (inputs + outputs)": 2 * per_chunk,
                                      "streamed (two layers)": stream_state_bytes(cfg)},
               "modes": {}}
    ref = None
    for name, fn in modes.items():
        seconds, (caches, last) = timed(functools.partial(fn, tokens), args.repeats)
        row = {"ms": seconds * 1e3, "ms_per_chunk": seconds * 1e3 / num_chunks}
        if ref is None:
            ref = jax.device_get((caches, last))
        else:
            row["equal_leaves"], row["leaves"], row["max_abs_diff"] = compare(caches, ref[0])
            row["logits_equal"] = bool(np.array_equal(np.asarray(last), ref[1]))
        results["modes"][name] = row
        del caches, last

    # the final upload of streamed_prefill, and the link alone (no compute)
    prefix = stream_prefix(params, cfg, tokens[:chunk], chunk)
    jax.block_until_ready(prefix.caches)
    up_s, uploaded = timed(prefix.to_device, args.repeats)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    down_s, _ = timed(functools.partial(jax.device_put, uploaded, host), args.repeats)
    results["upload_ms"] = up_s * 1e3
    results["link_GB_per_s"] = {"host_to_device": per_chunk / up_s / 1e9,
                                "device_to_host": per_chunk / down_s / 1e9}
    del uploaded, prefix

    # device bytes the stream holds (sampled after every layer) beyond what existed before
    base, peak = bytes_in_use(dev), [0]
    if base is not None:
        def sample(event):
            peak[0] = max(peak[0], bytes_in_use(dev) - base)
        p = stream_prefix(params, cfg, tokens[:2 * chunk], chunk, on_layer=sample)
        jax.block_until_ready(p.caches)
        results["streamed_bytes_in_use_max"] = peak[0]

    base_ms = results["modes"]["layers/device"]["ms"]
    for name in ("streamed", "no overlap"):
        row = results["modes"][name]
        extra = (row["ms"] - base_ms) / 1e3
        row["eff_GB_per_s"] = streamed_bytes / extra / 1e9 if extra > 0 else float("inf")
    results["total_s"] = time.perf_counter() - t_start
    path = pathlib.Path(args.out) / "prefill_stream_gpu.json"
    path.write_text(json.dumps(results, indent=2))

    mb = 1e6  # bytes per MB
    print(f"device={results['device']} jax={results['jax']} prompt={n} chunk={chunk} "
          f"chunks={num_chunks} layers={''.join(k[0] for k in cfg.layer_pattern)}")
    print(f"layer state S_l (MB): {[round(s / mb, 3) for s in state]}; per chunk each way "
          f"{per_chunk / mb:.2f} MB; streamed in all {streamed_bytes / mb:.1f} MB")
    print(f"device state bytes (MB): monolithic 2*sum S_l = {2 * per_chunk / mb:.2f}, streamed "
          f"max S_l+S_l+1 = {stream_state_bytes(cfg) / mb:.2f}, streamed measured max "
          f"bytes_in_use = {results.get('streamed_bytes_in_use_max', float('nan')) / mb:.2f}")
    link = results["link_GB_per_s"]
    print(f"link alone: H2D {link['host_to_device']:.1f} GB/s, D2H {link['device_to_host']:.1f} "
          f"GB/s (PCIe {PCIE / 1e9:.0f} GB/s); final upload {results['upload_ms']:.1f} ms; "
          f"compile+warm-up {compile_s:.1f} s; total {results['total_s']:.1f} s")
    print(f"{'mode':14s} {'ms':>9s} {'ms/chunk':>9s} {'eff GB/s':>9s} {'vs link':>8s} "
          f"{'bit-equal leaves':>17s} {'max|diff|':>10s} {'logits':>7s}")
    for name, row in results["modes"].items():
        gbs = row.get("eff_GB_per_s")
        eff = f"{gbs:9.1f} {gbs * 1e9 / PCIE:8.2f}" if gbs is not None else f"{'':9s} {'':8s}"
        eq = (f"{row['equal_leaves']:>8d}/{row['leaves']:<8d} {row['max_abs_diff']:10.2e} "
              f"{'same' if row['logits_equal'] else 'diff':>7s}") if "leaves" in row else \
            f"{'reference':>17s}"
        print(f"{name:14s} {row['ms']:9.1f} {row['ms_per_chunk']:9.2f} {eff} {eq}")


if __name__ == "__main__":
    main()
