"""Echo's intra-query prefetch (``CacheConfig.prefetch_rows``) on the trained small model: how
many of the selection's host copies it turns into buffer hits, at what extra traffic.

Run: JAX_PLATFORMS=cpu python benchmarks/echo_prefetch.py [--prompts 4 --prompt-tokens 4096
--tokens 64 --buffer 64 --bands 0,8,16,32,48 --seed-offset 6000000 --out DIR]
Held-out NIAH prompts (seeds seed_offset .. seed_offset + prompts - 1, never used in training
or tuning), checkpoints/small, greedy, every request decoding together. Each band P runs echo
with the same buffer (hot_cache_rows; with --grow-buffer, the buffer plus P rows for the
prefetch) and prefetches the P positions ranked after the top-k at every step; the tokens
must equal resident's (the prefetch is lossless). Per CSA layer and step: selected rows
copied on demand, rows prefetched, and the host rows in all.
"""

import argparse
import json
import pathlib

import numpy as np

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.model.presets import fit_max_len, preset
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import sparse_layers
from lsparse_jax.training import load_params
from lsparse_jax.training.data import task_example


def run(cfg, params, prompts, tokens, method, buffer=None, band=0):
    """Generated tokens and the engine's selection metrics after ``tokens`` decode steps."""
    cache = CacheConfig(len(prompts), 512, buffer, 16, shared_pool_rows=(
        buffer * len(prompts) + sum(len(p) for p in prompts) if method == "echo" else None),
        prefetch_rows=band)
    engine = Engine(EngineConfig(model=cfg, method=method, cache=cache,
                                 sampling=SamplingConfig(0.0, 0)), params)
    for p in prompts:
        engine.admit(p, max_new_tokens=tokens)
    engine.decode(tokens - 1)  # admission sampled the first token
    return [list(map(int, g)) for g in engine.generated], engine.metrics()["selection"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=64, help="hot_cache_rows of every run")
    ap.add_argument("--bands", default="0,8,16,32,48")
    ap.add_argument("--grow-buffer", action="store_true", help="band P runs with buffer + P "
                    "rows (default: every band with the same buffer)")
    ap.add_argument("--seed-offset", type=int, default=6_000_000)
    ap.add_argument("--out", default=None, help="a folder for echo_prefetch.json")
    a = ap.parse_args()
    cfg = fit_max_len(preset("small"), a.prompt_tokens + a.tokens)
    params = load_params("checkpoints/small", cfg)
    prompts = [np.asarray(task_example("niah", a.prompt_tokens, a.seed_offset + s).prompt,
                          np.int32) for s in range(a.prompts)]
    steps = a.prompts * (a.tokens - 1) * len(sparse_layers(cfg))  # slot-layer steps
    want, _ = run(cfg, params, prompts, a.tokens, "resident")
    rows = []
    for band in map(int, a.bands.split(",")):
        buffer = a.buffer + (band if a.grow_buffer else 0)
        got, sel = run(cfg, params, prompts, a.tokens, "echo", buffer, band)
        row = {"band": band, "buffer": buffer, "same_tokens_as_resident": got == want,
               "on_demand_rows_per_step": sel["host_rows"] / steps,
               "prefetched_rows_per_step": sel["prefetched_rows"] / steps,
               "host_rows_per_step": (sel["host_rows"] + sel["prefetched_rows"]) / steps,
               "hot_fraction": sel["resolved_fraction"]["hot_cache"],
               "reuse": sel["reuse_fraction"]}
        rows.append(row)
        print(f"P {band:>3}, buffer {buffer}: on demand "
              f"{row['on_demand_rows_per_step']:.2f}, prefetched "
              f"{row['prefetched_rows_per_step']:.2f}, host in all "
              f"{row['host_rows_per_step']:.2f} rows a step; hits "
              f"{row['hot_fraction']:.3f}; reuse {row['reuse']:.3f}; same tokens "
              f"{row['same_tokens_as_resident']}", flush=True)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "echo_prefetch_grown.json" if a.grow_buffer else "echo_prefetch.json"
        (out / name).write_text(json.dumps(
            {"args": vars(a), "top_k": cfg.indexer.top_k, "rows": rows}, indent=2) + "\n")
