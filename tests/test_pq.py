"""Product quantization of indexer keys: exact identities, numpy references, k-means, orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lsparse_jax.indexing import index_scores
from lsparse_jax.quant import coarse_scores, decode, encode, pq, train_codebooks
from lsparse_jax.quant.pq import load_codebooks, save_codebooks


def dictionary_keys(rng, n, m, k, dsub, dyadic):
    """Keys [N, M*d] whose j-th subvector is one of K distinct vectors dictionary[j] [K, d].

    Returns (keys, codes [N, M], dictionary [M, K, d]). Every dictionary entry is used. Dyadic
    entries (multiples of 1/4) make k-means means exact in f32.
    """
    while True:
        if dyadic:
            dictionary = (rng.integers(-8, 9, size=(m, k, dsub)) / 4).astype(np.float32)
        else:
            dictionary = rng.normal(size=(m, k, dsub)).astype(np.float32)
        if all(len(np.unique(dictionary[j], axis=0)) == k for j in range(m)):
            break
    codes = rng.integers(0, k, size=(n, m))
    codes[:k] = np.arange(k)[:, None]
    codes = rng.permuted(codes, axis=0)
    keys = dictionary[np.arange(m), codes].reshape(n, m * dsub)
    return keys, codes.astype(np.uint8), dictionary


def reference_codes(keys, codebooks):
    """Brute-force nearest centroid per subspace in f64; np.argmin breaks ties to the lower id."""
    m, _, dsub = codebooks.shape
    x = np.asarray(keys, np.float64).reshape(*keys.shape[:-1], m, 1, dsub)
    d2 = np.sum((x - np.asarray(codebooks, np.float64)) ** 2, axis=-1)  # [..., M, K]
    return np.argmin(d2, axis=-1), d2


def objective(keys, codebooks):
    """k-means objective: mean over keys of the squared distance to the nearest reconstruction."""
    _, d2 = reference_codes(keys, codebooks)
    return float(np.mean(np.sum(np.min(d2, axis=-1), axis=-1)))


def eq6_reference(q, w, codes, codebooks):
    """Direct transcription of Eq. 6 in f64: s_i = sum_h w_h ReLU(sum_j q_{h,j} . C_j[c_ij])."""
    b, h, d = q.shape
    m, _, dsub = codebooks.shape
    q = q.astype(np.float64).reshape(b, h, m, dsub)  # q_{h,j}
    cents = codebooks.astype(np.float64)[np.arange(m), codes]  # C_j[c_ij]: [B, N, M, d]
    s = np.zeros(codes.shape[:2])
    for bi in range(b):
        for hi in range(h):
            inner = sum(cents[bi, :, j] @ q[bi, hi, j] for j in range(m))  # [N]
            s[bi] += w[bi, hi] * np.maximum(inner, 0.0)
    return s


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# ------------------------------------------------------------------------ 1. exact reproduction


@pytest.mark.parametrize("trained", [False, True])
def test_exact_codebooks_give_exact_scores(trained):
    rng = np.random.default_rng(1)
    m, k, dsub = 4, 8, 4
    keys, codes, dictionary = dictionary_keys(rng, 200, m, k, dsub, dyadic=trained)
    if trained:
        # the data has exactly K distinct subvectors per subspace, so k-means (with empty-cluster
        # re-seeding) ends with exactly those as centroids, in some order
        codebooks = np.asarray(train_codebooks(keys, m, k, iters=30, seed=3))
        for j in range(m):
            np.testing.assert_array_equal(np.unique(codebooks[j], axis=0),
                                          np.unique(dictionary[j], axis=0))
    else:
        codebooks = dictionary
        np.testing.assert_array_equal(np.asarray(encode(keys, codebooks)), codes)
    back = decode(encode(keys, codebooks), codebooks)
    assert back.dtype == jnp.float32
    np.testing.assert_array_equal(bits(back), bits(keys))

    q = rng.normal(size=(2, 3, m * dsub)).astype(np.float32)
    w = rng.normal(size=(2, 3)).astype(np.float32)
    batch_keys = np.stack([keys, keys[::-1]])  # [2, N, D]
    got = coarse_scores(q, w, encode(batch_keys, codebooks), codebooks)
    want = index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(batch_keys))
    assert got.shape == (2, 200) and got.dtype == jnp.float32
    np.testing.assert_array_equal(bits(got), bits(want))


# ---------------------------------------------------------------------------- 2. nearest centroid


def test_encode_exact_ties_go_to_lower_id():
    rng = np.random.default_rng(2)
    m, k, dsub = 3, 12, 2
    # small integers: every distance is exact in f32, so ties are real ties
    codebooks = rng.integers(-3, 4, size=(m, k, dsub)).astype(np.float32)
    codebooks[:, 7] = codebooks[:, 2]  # duplicate centroids: id 2 must win
    keys = rng.integers(-4, 5, size=(2, 3, 50, m * dsub)).astype(np.float32)
    codes = encode(keys, codebooks)
    assert codes.shape == (2, 3, 50, m) and codes.dtype == jnp.uint8
    want, d2 = reference_codes(keys, codebooks)
    np.testing.assert_array_equal(np.asarray(codes), want)
    assert not np.any(np.asarray(codes) == 7)
    # ties are exercised: many keys have several nearest centroids
    n_nearest = np.sum(d2 == d2.min(axis=-1, keepdims=True), axis=-1)
    assert np.mean(n_nearest > 1) > 0.3

    # hand-made tie: key 1 is equally far from centroids 0 (at 0) and 1 (at 2); key -1 from 0 and 2
    cb = np.array([[[0.0], [2.0], [-2.0]]], np.float32)
    np.testing.assert_array_equal(np.asarray(encode(np.array([[1.0], [-1.0], [3.0]]), cb)),
                                  [[0], [0], [1]])


def test_encode_random_matches_brute_force():
    rng = np.random.default_rng(3)
    m, k, dsub = 8, 256, 4
    codebooks = rng.normal(size=(m, k, dsub)).astype(np.float32)
    keys = rng.normal(size=(2 * pq._ENCODE_BATCH + 37, m * dsub)).astype(np.float32)  # remainder
    codes = np.asarray(encode(keys, codebooks)).astype(np.int64)
    want, d2 = reference_codes(keys, codebooks)
    chosen = np.take_along_axis(d2, codes[..., None], axis=-1)[..., 0]
    # the chosen centroid is nearest up to f32 rounding of the distances; exact matches otherwise
    np.testing.assert_allclose(chosen, d2.min(axis=-1), rtol=1e-5, atol=1e-6)
    assert np.mean(codes == want) > 0.999
    # encode works under an outer jit and on empty inputs
    np.testing.assert_array_equal(np.asarray(jax.jit(encode)(keys[:100], codebooks)),
                                  codes[:100])
    assert encode(np.zeros((0, m * dsub), np.float32), codebooks).shape == (0, m)


# -------------------------------------------------------------------------------------- 3. k-means


def clustered_keys(rng, n, m, dsub, clusters, noise):
    centers = rng.normal(size=(m, clusters, dsub)) * 3.0
    which = rng.integers(0, clusters, size=(n, m))
    x = centers[np.arange(m), which] + noise * rng.normal(size=(n, m, dsub))
    return x.reshape(n, m * dsub).astype(np.float32)


def test_train_deterministic_and_seeded():
    keys = np.random.default_rng(4).normal(size=(300, 16)).astype(np.float32)
    a = train_codebooks(keys, 4, 16, iters=5, seed=7)
    b = train_codebooks(jnp.asarray(keys), 4, 16, iters=5, seed=7)
    c = train_codebooks(keys, 4, 16, iters=5, seed=8)
    assert a.shape == (4, 16, 4) and a.dtype == jnp.float32
    np.testing.assert_array_equal(bits(a), bits(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # the initial codebook is K distinct rows of the data in every subspace
    init = np.asarray(pq._init_codebooks(pq._split_subspaces(jnp.asarray(keys), 4), 16, 7))
    sub = keys.reshape(300, 4, 4)
    for j in range(4):
        rows = [np.flatnonzero(np.all(sub[:, j] == init[j, i], axis=-1)) for i in range(16)]
        assert all(r.size == 1 for r in rows) and len({int(r[0]) for r in rows}) == 16


def test_train_objective_decreases_on_clustered_data():
    rng = np.random.default_rng(5)
    m, dsub, k = 4, 4, 16
    keys = clustered_keys(rng, 2000, m, dsub, clusters=k, noise=0.05)
    init = pq._init_codebooks(pq._split_subspaces(jnp.asarray(keys), m), k, 0)
    history = [objective(keys, init)]
    for iters in (1, 2, 3, 5, 10, 20):
        history.append(objective(keys, train_codebooks(keys, m, k, iters=iters, seed=0)))
    # Lloyd steps with empty-cluster re-seeding never increase the objective
    assert all(b <= a * (1 + 1e-6) for a, b in zip(history, history[1:])), history
    assert history[-1] < 0.5 * history[0], history
    # converged (the last steps no longer move it): every centroid is the mean of its cluster
    cb = np.asarray(train_codebooks(keys, m, k, iters=20, seed=0))
    codes = np.asarray(encode(keys, cb))
    sub = keys.reshape(-1, m, dsub)
    for j in range(m):
        for i in np.unique(codes[:, j]):
            np.testing.assert_allclose(cb[j, i], sub[codes[:, j] == i, j].mean(axis=0),
                                       rtol=1e-5, atol=1e-6)


def numpy_lloyd(x, c, iters):
    """Reference k-means in one subspace: x [N, d], c [K, d], with the empty-cluster rule.

    Returns (centroids, number of re-seeded clusters over all steps).
    """
    x, c = x.astype(np.float64), c.astype(np.float64)
    reseeded = 0
    for _ in range(iters):
        d2 = np.sum((x[:, None] - c[None]) ** 2, axis=-1)
        assign, err = np.argmin(d2, axis=1), np.min(d2, axis=1)
        worst = np.argsort(-err, kind="stable")
        new, j = c.copy(), 0
        for i in range(len(c)):
            if np.any(assign == i):
                new[i] = x[assign == i].mean(axis=0)
            else:  # the j-th empty cluster takes the j-th worst point
                new[i], j = x[worst[j]], j + 1
        c, reseeded = new, reseeded + j
    return c, reseeded


def test_train_matches_numpy_lloyd():
    rng = np.random.default_rng(10)
    m, k, iters = 2, 40, 6
    # 32 distinct rows twice: 40 sampled rows hold duplicates, so the first step has empty clusters
    keys = np.tile(rng.normal(size=(32, 6)).astype(np.float32), (2, 1))[rng.permutation(64)]
    got = np.asarray(train_codebooks(keys, m, k, iters=iters, seed=2))
    init = np.asarray(pq._init_codebooks(pq._split_subspaces(jnp.asarray(keys), m), k, 2))
    sub = keys.reshape(64, m, 3)
    for j in range(m):
        want, reseeded = numpy_lloyd(sub[:, j], init[j], iters)
        assert reseeded >= k - 32
        np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-6)


def test_empty_clusters_are_reseeded():
    # 3 distinct rows among 20 and K = 16: the sampled initial centroids are mostly duplicates
    rng = np.random.default_rng(6)
    distinct = rng.normal(size=(3, 4)).astype(np.float32)
    keys = distinct[rng.permutation(np.arange(20) % 3)]
    cb = np.asarray(train_codebooks(keys, 2, 16, iters=4, seed=0))
    assert np.all(np.isfinite(cb))
    used = np.asarray(encode(keys, cb))
    sub = keys.reshape(20, 2, 2)
    for j in range(2):
        for i in range(16):
            is_point = np.any(np.all(sub[:, j] == cb[j, i], axis=-1))
            assert i in used[:, j] or is_point, (j, i)
    np.testing.assert_array_equal(np.asarray(decode(used, cb)), keys)

    # distinct points with K = N: every point ends up as its own centroid
    keys = rng.normal(size=(24, 6)).astype(np.float32)
    cb = train_codebooks(keys, 3, 24, iters=3, seed=1)
    np.testing.assert_array_equal(np.asarray(decode(encode(keys, cb), cb)), keys)


def test_lloyd_step_reseeds_jth_empty_cluster_with_jth_worst_point():
    x = jnp.array([[0.0], [1.0], [10.0], [20.0], [30.0]])
    c = jnp.array([[0.0], [0.0], [0.0], [100.0]])  # 1, 2 are duplicates of 0; 3 is too far
    # everything goes to centroid 0 (errors 0, 1, 100, 400, 900); 1, 2, 3 are empty and take
    # the worst (30), second worst (20) and third worst (10) points
    new = np.asarray(pq._lloyd_step(x, c))[:, 0]
    np.testing.assert_array_equal(new[1:], [30, 20, 10])
    np.testing.assert_allclose(new[0], 61 / 5, rtol=1e-6)


# -------------------------------------------------------------------------- 4. Eq. 6 reference


def test_coarse_scores_match_eq6():
    rng = np.random.default_rng(7)
    b, h, n, m, k, dsub = 2, 4, 33, 8, 256, 4
    codebooks = rng.normal(size=(m, k, dsub)).astype(np.float32)
    codes = rng.integers(0, k, size=(b, n, m)).astype(np.uint8)
    codes[0, 0] = 255  # the top uint8 code
    q = rng.normal(size=(b, h, m * dsub)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, size=(b, h)).astype(np.float32)
    got = np.asarray(coarse_scores(q, w, codes, codebooks))
    want = eq6_reference(q, w, codes, codebooks)
    assert 0 < np.mean(want == 0) < 0.5  # the ReLU clamps some keys and passes most
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(coarse_scores)(q, w, codes, codebooks)), want,
                               rtol=1e-5, atol=1e-5)


def test_decode_out_of_range_code_is_nan():
    cb = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    back = np.asarray(decode(np.array([[2, 3], [-1, 0]], np.int32), cb))
    np.testing.assert_array_equal(back[0, :2], cb[0, 2])
    assert np.all(np.isnan(back[0, 2:])) and np.all(np.isnan(back[1, :2]))
    np.testing.assert_array_equal(back[1, 2:], cb[1, 0])


# ------------------------------------------------------------------------------ 5. checkpoints


def test_save_load_round_trip(tmp_path, monkeypatch):
    rng = np.random.default_rng(8)
    layers = {0: rng.normal(size=(8, 256, 4)).astype(np.float32),
              5: train_codebooks(rng.normal(size=(64, 12)), 3, 16, iters=2)}
    save_codebooks(tmp_path / "pq", layers)
    loaded = load_codebooks(str(tmp_path / "pq"))
    assert list(loaded) == [0, 5]
    for layer, cb in layers.items():
        assert isinstance(loaded[layer], np.ndarray) and loaded[layer].dtype == np.float32
        np.testing.assert_array_equal(loaded[layer].view(np.uint32), bits(cb))
    # relative paths resolve against the working directory
    monkeypatch.chdir(tmp_path)
    save_codebooks("rel", {3: layers[0]})
    assert list(load_codebooks(tmp_path / "rel")) == [3]


@pytest.mark.parametrize("layers, match", [
    ({0: np.ones((4, 4), np.float32)},
     r"save_codebooks: codebook of layer 0 must be a 3-D float32 array .*\(4, 4\)"),
    ({0: np.ones((2, 4, 4), np.float64)}, "layer 0 must be a 3-D float32 array.*float64"),
    ({"a": np.ones((2, 4, 4), np.float32)}, "layer keys must be ints >= 0, got 'a'"),
    ({-1: np.ones((2, 4, 4), np.float32)}, "layer keys must be ints >= 0, got -1"),
    ({}, "codebooks_by_layer is empty"),
])
def test_save_validates_codebooks(tmp_path, layers, match):
    with pytest.raises(ValueError, match=match):
        save_codebooks(tmp_path / "pq", layers)
    assert not (tmp_path / "pq").exists()


def test_load_validates_stored_codebooks(tmp_path):
    ckpt = ocp.PyTreeCheckpointer()
    ckpt.save(str(tmp_path / "flat"), {"0": np.ones((4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"layer 0 must be a 3-D float32 array .*\(4, 4\)"):
        load_codebooks(tmp_path / "flat")
    ckpt.save(str(tmp_path / "f64"), {"1": np.ones((2, 4, 4), np.float64)})
    with pytest.raises(ValueError, match="layer 1 must be a 3-D float32 array.*float64"):
        load_codebooks(tmp_path / "f64")
    ckpt.save(str(tmp_path / "name"), {"enc": np.ones((2, 4, 4), np.float32)})
    with pytest.raises(ValueError, match="'enc' .* is not a layer id"):
        load_codebooks(tmp_path / "name")


# ------------------------------------------------------------------------------- 6. bad input


KEYS = np.random.default_rng(9).normal(size=(64, 16)).astype(np.float32)
CB = np.random.default_rng(9).normal(size=(4, 8, 4)).astype(np.float32)  # M=4, K=8, d=4: D=16
BAD_KEYS = KEYS.copy()
BAD_KEYS[3, 5] = np.nan
INF_KEYS = KEYS.copy()
INF_KEYS[0, 0] = -np.inf
Q, W = np.ones((2, 16), np.float32), np.ones(2, np.float32)
CODES = np.zeros((5, 4), np.uint8)


@pytest.mark.parametrize("call, match", [
    (lambda: train_codebooks(KEYS[0], 4), r"keys must be 2-D \[N, D\], got shape \(16,\)"),
    (lambda: train_codebooks(KEYS[None], 4), r"keys must be 2-D .*\(1, 64, 16\)"),
    (lambda: train_codebooks(KEYS, 5), "num_subspaces=5 must divide the key dim D=16"),
    (lambda: train_codebooks(KEYS, 0), "num_subspaces=0 must be >= 1"),
    (lambda: train_codebooks(KEYS, 4.0), r"num_subspaces=4.0 must be an int"),
    (lambda: train_codebooks(np.ones((300, 16)), 4, 257), r"num_centroids=257 must be <= 256"),
    (lambda: train_codebooks(KEYS, 4, 65), "num_centroids=65 must be <= the number of keys N=64"),
    (lambda: train_codebooks(KEYS, 4, 8, iters=0), "iters=0 must be >= 1"),
    (lambda: train_codebooks(KEYS, 4, 8, seed=-1), "seed=-1 must be >= 0"),
    (lambda: train_codebooks(BAD_KEYS, 4, 8), "keys contain NaN or inf"),
    (lambda: train_codebooks(INF_KEYS, 4, 8), "keys contain NaN or inf"),
    (lambda: encode(KEYS[:, :12], CB),
     r"encode: codebooks have 4 subspaces of dim 4 \(D=16\) but keys have D=12"),
    (lambda: encode(KEYS, CB[0]), r"encode: codebooks must be 3-D \[M, K, D/M\]"),
    (lambda: encode(KEYS[0], CB), r"encode: keys must be \[..., N, D\]"),
    (lambda: encode(KEYS, np.zeros((4, 300, 4), np.float32)),
     "K=300 centroids but uint8 codes hold at most 256"),
    (lambda: decode(np.zeros((5, 3), np.uint8), CB),
     "decode: codes have last dim 3 but codebooks have M=4 subspaces"),
    (lambda: decode(np.zeros((5, 4), np.float32), CB), "decode: codes must be integers"),
    (lambda: decode(CODES, CB[..., 0]), r"decode: codebooks must be 3-D"),
    (lambda: coarse_scores(np.ones((2, 12), np.float32), W, CODES, CB),
     r"coarse_scores: codebooks have 4 subspaces of dim 4 \(D=16\) but queries have D=12"),
    (lambda: coarse_scores(Q, np.ones(3, np.float32), CODES, CB),
     r"weights \[..., H\] have shape \(3,\) but q \[..., H, D\] has H=2 heads"),
    (lambda: coarse_scores(Q, W, np.zeros((5, 2), np.uint8), CB),
     "coarse_scores: codes have last dim 2 but codebooks have M=4 subspaces"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
