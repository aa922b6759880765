"""Engine.release on CPU: admit S requests, one decode step, release all S; prints the seconds.

Run: JAX_PLATFORMS=cpu python benchmarks/release_cpu.py [--slots 32]
The session-13 figure (RESULTS.md "Release copied every pool"): `small` preset at max_len
8,320, hisparse, 32 slots, a 35 MB tier: 0.254 s before the fix, 0.097 s after.
"""

import argparse
import time

import jax
import numpy as np

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.model import init_params, preset
from lsparse_jax.serving.engine import Engine

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    slots = ap.parse_args().slots
    cfg = preset("small", max_len=8192 + 128)
    engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(slots, 1024, 256, 64,
                                                              host_pages=slots * 33),
                                 sampling=SamplingConfig(0.0, 0), method="hisparse",
                                 implementation="xla"), init_params(cfg, 0), None)
    prompt = np.random.default_rng(0).integers(0, 200, 256).tolist()
    admitted = [engine.admit(prompt, 4) for _ in range(slots)]
    engine.step()
    jax.block_until_ready(engine.state)
    tier_mb = sum(x.nbytes for x in jax.tree.leaves(engine.state.tier)) / 1e6
    t0 = time.perf_counter()
    for s in admitted:
        engine.release(s)
    jax.block_until_ready(engine.state)
    print(f"tier {tier_mb:.0f} MB; release of {slots} slots: {time.perf_counter() - t0:.3f} s")
