"""The drafter's two rings (``DrafterConfig.ring``: "kv" keys/values, "features" target
features) served on the same prompts: acceptance, tokens (equal: greedy-exact), ring bytes.

Run: JAX_PLATFORMS=cpu python benchmarks/drafter_ring.py [--prompts 4 --prompt-tokens 1024
--tokens 48 --method hisparse --seed-offset 5000000 --out DIR]
Held-out NIAH prompts (seeds seed_offset .. seed_offset + prompts - 1), the trained small model
and drafter (checkpoints/small, checkpoints/drafter_small), greedy. Session 17 (CPU): both rings
3.254 tokens per verification, ring bytes 524,800 (kv) vs 131,584 (features). draft_ms: one
drafting of every slot, timed apart after serving (``SpecEngine.drafter_seconds``): the
feature ring recomputes its window's keys and values at each draft.
"""

import argparse
import dataclasses
import json
import pathlib

import numpy as np

from experiments.speculative import serve_prompts
from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig, method_storage
from lsparse_jax.model.presets import fit_max_len, preset
from lsparse_jax.serving.speculative import SpecEngine
from lsparse_jax.training import load_params
from lsparse_jax.training.data import task_example
from lsparse_jax.training.drafter import load_drafter


def serve(config, params, drafter, prompts, tokens):
    """Tokens per request, the engine's metrics (with draft_ms) and its decode seconds (warmup
    excluded)."""
    engine = SpecEngine(config, params, drafter)
    out, _, _ = serve_prompts(engine, prompts, tokens)
    m = engine.metrics() | {"draft_ms": 1e3 * engine.drafter_seconds()}
    return [list(map(int, t)) for t in out], m, m["decode_seconds"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--method", default="hisparse")
    ap.add_argument("--seed-offset", type=int, default=5_000_000)
    ap.add_argument("--out", default=None, help="a folder for drafter_ring.json")
    a = ap.parse_args()
    cfg = fit_max_len(preset("small"), a.prompt_tokens + a.tokens)
    params = load_params("checkpoints/small", cfg)
    dparams, dcfg = load_drafter("checkpoints/drafter_small")
    prompts = [np.asarray(task_example("niah", a.prompt_tokens, a.seed_offset + s).prompt,
                          np.int32) for s in range(a.prompts)]
    paged = method_storage(a.method).kv_on_host
    config = EngineConfig(model=cfg, method=a.method, sampling=SamplingConfig(0.0, 0),
                          cache=CacheConfig(a.prompts, 256, 128 if paged else None, 16))
    rows, tokens = [], {}
    for ring in ("kv", "features"):
        tokens[ring], m, secs = serve(config, params, (dparams, dataclasses.replace(
            dcfg, ring=ring)), prompts, a.tokens)
        rows.append({"ring": ring, "acceptance_length": m["acceptance_length"],
                     "acceptance_histogram": m["acceptance_histogram"],
                     "ring_bytes": m["spec_state_bytes_per_request"], "decode_s": secs,
                     "draft_ms": m["draft_ms"]})
        print(f"{ring:>8}: acceptance {m['acceptance_length']:.3f} "
              f"{m['acceptance_histogram']} ring {m['spec_state_bytes_per_request']:,} B "
              f"decode {secs:.2f} s, one drafting {m['draft_ms']:.2f} ms")
    same = tokens["kv"] == tokens["features"]
    print("same tokens:", same)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "drafter_ring.json").write_text(json.dumps(
            {"args": vars(a), "rows": rows, "same_tokens": same}, indent=2) + "\n")
