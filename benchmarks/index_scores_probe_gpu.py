"""Issue 15's divergence probe: index_scores Triton vs its XLA twin at the shapes the engine
calls it with (C + T candidates, often not a multiple of the kernel's block; under vmap over
slots), on random inputs with invalid rows NaN-poisoned. Prints one line per case: the largest
|triton - xla| over valid rows relative to the largest |xla|, and whether any -inf / NaN landed
on a valid row. Run on the GPU: python benchmarks/index_scores_probe_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_scores.api import index_scores


def inputs(rng, b, h, d, c, nb):
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    w = rng.standard_normal((b, h)).astype(np.float32)
    kv = jnp.asarray(rng.standard_normal((b, c, d)), jnp.float8_e4m3fn)
    ks = rng.uniform(0.5, 2.0, (b, c, nb)).astype(np.float32)
    valid = rng.random((b, c)) < 0.8
    ks = np.where(valid[..., None], ks, np.nan).astype(np.float32)  # NaN poison
    return jnp.asarray(q), jnp.asarray(w), kv, jnp.asarray(ks), jnp.asarray(valid)


def report(name, got, want, valid):
    got, want, valid = map(np.asarray, (got, want, valid))
    ok = valid & np.isfinite(want)
    err = np.abs(got - want)[ok].max()
    rel = err / max(np.abs(want[ok]).max(), 1e-30)
    bad = int((valid & ~np.isfinite(got)).sum())
    inv = int((~valid & (got != -np.inf)).sum())
    print(f"{name:44s} rel {rel:9.3g}  nonfinite@valid {bad:5d}  not -inf@invalid {inv:5d}",
          flush=True)
    return rel


def main():
    rng = np.random.default_rng(0)
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    for h, d, nb in ((4, 32, 1), (64, 128, 1)):
        for c in (64, 80, 128, 2048, 2112):
            for b in (1, 4):
                args = inputs(rng, b, h, d, c, nb)
                want = index_scores(*args, implementation="xla")
                got = jax.jit(lambda *a: index_scores(*a, implementation="triton"))(*args)
                report(f"H{h} D{d} C{c} B{b} direct", got, want, args[-1])
                # the engine's form: one request per call under a vmap over slots
                one = lambda q, w, kv, ks, v: index_scores(  # noqa: E731
                    q[None], w[None], kv[None], ks[None], v[None], implementation="triton")[0]
                got = jax.jit(jax.vmap(one))(*args)
                report(f"H{h} D{d} C{c} B{b} vmap of B1", got, want, args[-1])


if __name__ == "__main__":
    main()
