"""Product quantization (PQ) of lightning-indexer keys (LeanSparse).

A key of D values is split into M subspaces of D / M values; subspace j has a codebook C_j of
K <= 256 centroids, and the key is stored as M uint8 codes c_j (the id of its nearest centroid).
Coarse indexer scores are computed on the reconstruction k'_i = concat_j C_j[c_ij] (Eq. 6):

    s_i = sum_h w_h * ReLU( sum_j q_{h,j} . C_j[c_ij] )

``train_codebooks`` fits the codebooks by k-means per subspace; ``encode`` / ``decode`` map keys to
codes and back; ``coarse_scores`` is the XLA reference of Eq. 6; ``save_codebooks`` /
``load_codebooks`` store one codebook per layer with orbax-checkpoint.
"""

import operator
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.pq_topc.reference import coarse_scores as _coarse_scores
from pallas_kernels.pq_topc.reference import decode_codes

MAX_CENTROIDS = 256  # codes are uint8
_ENCODE_BATCH = 2048  # keys per vectorised encode step: bounds the [batch, M, K] distance buffer


# ----------------------------------------------------------------------------------- validation


def _check_int(fn: str, name: str, value, lo: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int, numpy or concrete jax integer scalars
    except TypeError:
        raise ValueError(f"{fn}: {name}={value!r} must be an int >= {lo}") from None
    if value < lo:
        raise ValueError(f"{fn}: {name}={value} must be >= {lo}")
    return int(value)


def _check_codebooks(fn: str, codebooks, d: int | None, what: str) -> jnp.ndarray:
    """Checks codebooks are [M, K, D/M] with M * (D/M) == d (the D of ``what``, unless d is None);
    returns them as f32."""
    if codebooks.ndim != 3:
        raise ValueError(
            f"{fn}: codebooks must be 3-D [M, K, D/M], got shape {tuple(codebooks.shape)}")
    m, k, dsub = codebooks.shape
    if k > MAX_CENTROIDS:
        raise ValueError(f"{fn}: codebooks have K={k} centroids but uint8 codes hold at most "
                         f"{MAX_CENTROIDS}")
    if d is not None and m * dsub != d:
        raise ValueError(f"{fn}: codebooks have {m} subspaces of dim {dsub} (D={m * dsub}) but "
                         f"{what} have D={d}")
    if not jnp.issubdtype(codebooks.dtype, jnp.floating):
        raise ValueError(f"{fn}: codebooks must be floating point, got dtype {codebooks.dtype}")
    return codebooks.astype(jnp.float32)


def _check_codes(fn: str, codes, m: int) -> None:
    if codes.ndim < 2:
        raise ValueError(f"{fn}: codes must be [..., N, M], got shape {tuple(codes.shape)}")
    if codes.shape[-1] != m:
        raise ValueError(
            f"{fn}: codes have last dim {codes.shape[-1]} but codebooks have M={m} subspaces")
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"{fn}: codes must be integers (uint8), got dtype {codes.dtype}")


def _check_stored(fn: str, layer, arr: np.ndarray) -> None:
    if arr.ndim != 3 or arr.dtype != np.float32:
        raise ValueError(f"{fn}: codebook of layer {layer} must be a 3-D float32 array "
                         f"[M, K, D/M], got shape {arr.shape} dtype {arr.dtype}")


# --------------------------------------------------------------------------------------- k-means


def _sqdist(x: jnp.ndarray, c: jnp.ndarray) -> jnp.ndarray:
    """Squared L2 distances [..., K] of x [..., d] to every centroid c [K, d].

    Formed from differences (not |x|^2 - 2 x.c + |c|^2) so that exact inputs give exact distances
    and exact ties, which ``argmin`` breaks to the lower centroid id.
    """
    return jnp.sum(jnp.square(x[..., None, :] - c), axis=-1)


def _lloyd_step(x: jnp.ndarray, c: jnp.ndarray) -> jnp.ndarray:
    """One k-means step in one subspace: x [N, d] points, c [K, d] centroids -> new c [K, d].

    Notation: N points, K centroids, d = D / M subspace dim.
    Assign each point to its nearest centroid (ties to the lower id), move each centroid to the
    mean of its members, then re-seed empty clusters: the j-th empty cluster (in id order) takes
    the point with the j-th largest quantization error of this assignment (ties to lower index).
    """
    n, k = x.shape[0], c.shape[0]
    d2 = _sqdist(x, c)  # [N, K]
    assign = jnp.argmin(d2, axis=-1)  # [N]
    err = jnp.min(d2, axis=-1)  # [N]
    onehot = assign[:, None] == jnp.arange(k)  # [N, K]
    counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)  # [K]
    # Mean as ref + mean(x - ref) with ref = the cluster's first member: a cluster of identical
    # points keeps exactly that point (XLA may turn the division into a reciprocal multiply).
    ref = x[jnp.argmax(onehot, axis=0)]  # [K, d]
    # One-hot matmul instead of a scatter-add: deterministic on GPU as well.
    sums = jnp.dot(onehot.T.astype(jnp.float32), x - ref[assign],
                   precision=jax.lax.Precision.HIGHEST)
    means = ref + sums / jnp.maximum(counts, 1)[:, None].astype(jnp.float32)
    empty = counts == 0
    _, worst = jax.lax.top_k(err, min(k, n))  # point ids by decreasing error; K <= N
    rank = jnp.clip(jnp.cumsum(empty) - 1, 0, None)  # j for the j-th empty cluster
    return jnp.where(empty[:, None], x[worst[rank]], means)


def _init_codebooks(xs: jnp.ndarray, num_centroids: int, seed: int) -> jnp.ndarray:
    """Initial codebooks [M, K, d]: K distinct rows of xs [M, N, d], sampled per subspace."""
    m, n, _ = xs.shape
    rngs = jax.random.split(jax.random.key(seed), m)
    idx = jax.vmap(lambda r: jax.random.permutation(r, n)[:num_centroids])(rngs)  # [M, K]
    return jnp.take_along_axis(xs, idx[:, :, None], axis=1)


@partial(jax.jit, static_argnames=("num_centroids",))
def _kmeans(xs: jnp.ndarray, num_centroids: int, seed: jnp.ndarray, iters: jnp.ndarray):
    """k-means of xs [M, N, d] in every subspace at once -> codebooks [M, K, d]."""
    c0 = _init_codebooks(xs, num_centroids, seed)
    step = jax.vmap(_lloyd_step)
    return jax.lax.fori_loop(0, iters, lambda _, c: step(xs, c), c0)


def _split_subspaces(keys: jnp.ndarray, m: int) -> jnp.ndarray:
    """keys [N, D] -> [M, N, D/M] f32."""
    n, d = keys.shape
    return keys.astype(jnp.float32).reshape(n, m, d // m).transpose(1, 0, 2)


def train_codebooks(keys, num_subspaces: int, num_centroids: int = MAX_CENTROIDS, *,
                    iters: int = 20, seed: int = 0) -> jnp.ndarray:
    """Fits PQ codebooks to keys [N, D] by k-means (Lloyd) in each subspace.

    Notation: N keys, D key dim, M = num_subspaces, K = num_centroids, d = D / M.
    Subspace j sees the points x_i = keys[i, j*d:(j+1)*d]. Its K centroids start as K distinct
    rows sampled with ``jax.random`` from ``seed`` (one independent draw per subspace); each of the
    ``iters`` steps assigns every point to its nearest centroid (squared L2, ties to the lower id)
    and moves each centroid to the mean of its members. A cluster left without members is
    re-seeded with a point of largest quantization error (the j-th empty cluster gets the j-th
    worst point), so no centroid is NaN or stale. The objective mean_i |x_i - C[a_i]|^2 never
    increases from one step to the next.

    Runs as one jit-compiled program (vmap over subspaces; memory O(M * N * K) floats) and is
    deterministic: the same keys, arguments and seed give bit-identical codebooks.
    Returns f32 codebooks [M, K, d]. Raises ValueError on bad shapes or arguments, and on keys
    that contain NaN or inf (which needs concrete keys: call it outside ``jax.jit``).
    """
    fn = "train_codebooks"
    keys = jnp.asarray(keys)
    if keys.ndim != 2:
        raise ValueError(f"{fn}: keys must be 2-D [N, D], got shape {tuple(keys.shape)}")
    if not (jnp.issubdtype(keys.dtype, jnp.floating) or jnp.issubdtype(keys.dtype, jnp.integer)):
        raise ValueError(f"{fn}: keys must be real numbers, got dtype {keys.dtype}")
    n, d = keys.shape
    m = _check_int(fn, "num_subspaces", num_subspaces, 1)
    k = _check_int(fn, "num_centroids", num_centroids, 1)
    iters = _check_int(fn, "iters", iters, 1)
    seed = _check_int(fn, "seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"{fn}: seed={seed} must be < 2**32")
    if d % m:
        raise ValueError(f"{fn}: num_subspaces={m} must divide the key dim D={d}")
    if k > MAX_CENTROIDS:
        raise ValueError(
            f"{fn}: num_centroids={k} must be <= {MAX_CENTROIDS} (codes are uint8)")
    if k > n:
        raise ValueError(f"{fn}: num_centroids={k} must be <= the number of keys N={n} "
                         "(centroids start as distinct keys)")
    if not bool(jnp.all(jnp.isfinite(keys))):
        raise ValueError(f"{fn}: keys contain NaN or inf")
    return _kmeans(_split_subspaces(keys, m), k, jnp.asarray(seed, jnp.uint32),
                   jnp.asarray(iters, jnp.int32))


# ---------------------------------------------------------------------------- encode and decode


@jax.jit
def _encode_rows(x: jnp.ndarray, codebooks: jnp.ndarray) -> jnp.ndarray:
    """x [T, M, d] f32 -> uint8 codes [T, M], vectorised over batches of keys."""

    def one(row):  # [M, d] -> [M]
        return jnp.argmin(jax.vmap(_sqdist)(row, codebooks), axis=-1).astype(jnp.uint8)

    return jax.lax.map(one, x, batch_size=_ENCODE_BATCH)


def encode(keys, codebooks) -> jnp.ndarray:
    """Encodes keys [..., N, D] as uint8 codes [..., N, M]: the nearest centroid per subspace.

    Notation: N keys, D key dim, M subspaces, K centroids, d = D / M; codebooks [M, K, d].
    c_ij = argmin_k |keys[i, j*d:(j+1)*d] - C_j[k]|^2 in f32, ties to the lower centroid id.
    """
    keys = jnp.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"encode: keys must be [..., N, D], got shape {tuple(keys.shape)}")
    codebooks = _check_codebooks("encode", jnp.asarray(codebooks), keys.shape[-1], "keys")
    m, _, dsub = codebooks.shape
    lead = keys.shape[:-1]
    rows = keys.astype(jnp.float32).reshape(-1, m, dsub)
    if rows.shape[0] == 0:
        return jnp.zeros((*lead, m), jnp.uint8)
    return _encode_rows(rows, codebooks).reshape(*lead, m)


def decode(codes, codebooks) -> jnp.ndarray:
    """Reconstructs keys [..., N, D] f32 from codes [..., N, M]: concat_j C_j[c_ij].

    Notation: N keys, M subspaces, K centroids, d = D / M; codebooks [M, K, d], D = M * d.
    A code outside [0, K) (never produced by ``encode``) decodes to NaN, not a clamped centroid.
    """
    codes = jnp.asarray(codes)
    codebooks = _check_codebooks("decode", jnp.asarray(codebooks), None, "")
    _check_codes("decode", codes, codebooks.shape[0])
    return decode_codes(codes, codebooks)


def coarse_scores(q, weights, codes, codebooks) -> jnp.ndarray:
    """Coarse indexer scores of PQ-coded keys (Eq. 6), the XLA reference for a fused kernel.

    Notation: H indexer heads, N keys, D dim, M subspaces, K centroids, d = D / M.
      q [..., H, D] (q_{h,j} = q[..., h, j*d:(j+1)*d]), weights [..., H], codes [..., N, M],
      codebooks [M, K, d].
    Math: s_i = sum_h w_h * ReLU( sum_j q_{h,j} . C_j[c_ij] ), computed by decoding the codes and
    calling ``index_scores`` (f32, HIGHEST precision); so codebooks that reproduce the keys exactly
    give exactly ``index_scores(q, weights, keys)``. Returns [..., N] f32.
    """
    q, weights, codes = jnp.asarray(q), jnp.asarray(weights), jnp.asarray(codes)
    if q.ndim < 2:
        raise ValueError(f"coarse_scores: q must be [..., H, D], got shape {tuple(q.shape)}")
    if weights.ndim < 1 or weights.shape[-1] != q.shape[-2]:
        raise ValueError(f"coarse_scores: weights [..., H] have shape {tuple(weights.shape)} but "
                         f"q [..., H, D] has H={q.shape[-2]} heads")
    codebooks = _check_codebooks("coarse_scores", jnp.asarray(codebooks), q.shape[-1], "queries")
    _check_codes("coarse_scores", codes, codebooks.shape[0])
    return _coarse_scores(q, weights, codes, codebooks)


# ------------------------------------------------------------------------------------ checkpoints


def save_codebooks(path, codebooks_by_layer: dict[int, jnp.ndarray]) -> None:
    """Saves {layer: f32 codebooks [M, K, d]} to the directory ``path`` with orbax-checkpoint.

    A relative path is resolved against the working directory (orbax needs absolute paths);
    orbax refuses to overwrite an existing checkpoint.
    """
    import orbax.checkpoint as ocp  # lazy: orbax is slow to import and only needed here

    if not codebooks_by_layer:
        raise ValueError("save_codebooks: codebooks_by_layer is empty")
    tree = {}
    for layer, cb in codebooks_by_layer.items():
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise ValueError(f"save_codebooks: layer keys must be ints >= 0, got {layer!r}")
        arr = np.asarray(cb)
        _check_stored("save_codebooks", layer, arr)
        tree[str(int(layer))] = arr
    ocp.PyTreeCheckpointer().save(os.path.abspath(os.fspath(path)), tree)


def load_codebooks(path) -> dict[int, np.ndarray]:
    """Loads the {layer: codebooks [M, K, d] f32} written by ``save_codebooks``.

    Raises ValueError when a stored entry is not a 3-D float32 array or not keyed by a layer id.
    """
    import orbax.checkpoint as ocp  # lazy: orbax is slow to import and only needed here

    restored = ocp.PyTreeCheckpointer().restore(os.path.abspath(os.fspath(path)))
    if not isinstance(restored, dict):
        raise ValueError(f"load_codebooks: {path} does not hold a dict of codebooks")
    out = {}
    for name, cb in restored.items():
        if not (isinstance(name, str) and name.isdigit()):
            raise ValueError(f"load_codebooks: entry {name!r} in {path} is not a layer id")
        arr = np.asarray(cb)
        _check_stored("load_codebooks", int(name), arr)
        out[int(name)] = arr
    return dict(sorted(out.items()))
