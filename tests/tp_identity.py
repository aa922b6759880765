"""Identity 11 run in its own process: engines with tp = 1 and tp = 2 on the same prompts.

Run as ``python -m tests.tp_identity METHOD... [--implementation xla|triton] [--steps N]
[--layers swa,csa,hca,csa]``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (set here if absent: it must be set
before jax starts, so the tests start this module in a subprocess and the rest of the suite
keeps one CPU device). Prints a JSON line per method: the greedy tokens of both engines, the
largest |logit difference| per step, whether every step's selections are equal, and where the
tp = 2 state lives (every leaf replicated on both devices, host pools still pinned_host).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig  # noqa: E402
from lsparse_jax.methods.leansparse import calibrate_codebooks  # noqa: E402
from lsparse_jax.serving.engine import Engine  # noqa: E402
from lsparse_jax.serving.request import Request  # noqa: E402
from lsparse_jax.serving.steps import decode_step  # noqa: E402
from tests.helpers import model_and_tokens, tiny  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py


def engine(method: str, tp: int, implementation: str, params, cfg, books) -> Engine:
    cache = CacheConfig(num_slots=2, prefill_chunk=32, page_size=8,
                        hot_cache_rows=None if method == "resident" else 16,
                        optional_pages=2 if method == "adaptive" else None)
    # a small C with the miss filter: the coarse pass, the filter and the rerank all run
    lean = LeanSparseConfig(num_candidates=16, miss_filter_offset=1.0, key_cache_rows=24)
    return Engine(EngineConfig(model=cfg, cache=cache, method=method, leansparse=lean,
                               implementation=implementation, tp=tp), params, books)


def placement(state) -> dict:
    """Where the tp = 2 state lives: all leaves replicated over both devices; memory kinds."""
    leaves = jax.tree.leaves(state)
    return {"replicated": all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 2
                              for a in leaves),
            "memory_kinds": sorted({a.sharding.memory_kind for a in leaves})}


def compare(method: str, implementation: str, steps: int, params, cfg, books) -> dict:
    one, two = (engine(method, tp, implementation, params, cfg, books) for tp in (1, 2))
    rng = np.random.default_rng(7)
    for length in (44, 29):  # two slots of different lengths
        prompt = rng.integers(0, cfg.vocab_size, length).astype(np.int32)
        for e in (one, two):
            e.admit(Request(prompt, max_new_tokens=steps + 1))
    logit_diff, same_selection, compiled = [], True, []
    for _ in range(steps):
        a, b = one.step(), two.step()
        compiled.append(decode_step._cache_size())
        logit_diff.append(float(np.max(np.abs(np.asarray(a.logits) - np.asarray(b.logits)))))
        same_selection &= bool(np.array_equal(np.asarray(a.selected), np.asarray(b.selected)))
    return {"tokens": [one.generated, two.generated], "logit_diff": logit_diff,
            "same_selection": same_selection, **placement(two.state),
            "recompiles": compiled[-1] - compiled[0]}  # after the first step: none expected


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("methods", nargs="+")
    parser.add_argument("--implementation", default="xla")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", default="swa,csa,hca,csa", help="the layer pattern")
    args = parser.parse_args(argv)
    if jax.device_count() < 2:
        raise SystemExit(f"tp_identity needs 2 devices, found {jax.device_count()}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=2 before jax starts")
    cfg = tiny(max_len=128, layer_pattern=tuple(args.layers.split(",")))
    params, calib = model_and_tokens(cfg, 128, seed=3)
    coarse = {"leansparse", "direct_pq"} & set(args.methods)  # PQ methods need codebooks
    books = calibrate_codebooks(params, cfg, calib, iters=2) if coarse else None
    for m in args.methods:  # a line per method as it finishes (a timeout keeps the done ones)
        print(json.dumps({m: compare(m, args.implementation, args.steps, params, cfg, books)}),
              flush=True)


if __name__ == "__main__":
    main()
