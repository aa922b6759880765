"""Recall study: how much of the exact indexer top-k PQ selection recovers.

Gin header -- must be set: run.experiment = @recall_study, run.name; recall_model.model (a
ModelConfig, e.g. @model_preset()) when 'model' is in recall_study.sources; recall_npz.path when
'npz' is in recall_study.sources. Everything else has a default (configs/experiments/recall.gin).
Writes runs/<name>/{config.gin, results.json, recall.png} (``LSPARSE_RUNS`` moves the root).

For each query, the reference is the exact indexer top-k over an eligible history (scores
I[n] = sum_h w_h ReLU(q_h . k_n), ``index_scores`` + ``topk_positions``). Two methods select k
positions from PQ codes of the same history and are scored by recall = |selected & exact| / k:
  direct_pq  top-k straight from the coarse PQ scores (Eq. 6);
  c2f        LeanSparse coarse-to-fine: PQ top-C, miss filter (offset None = off), exact rerank
             of the kept candidates (nothing cached, no exact tail: every kept one is fetched).
PQ: M = D / pq_subdim subspaces (4-dim subvectors, one byte each: PQ32 at D = 128) and
K = min(num_centroids, N_train) centroids, trained on keys the study never evaluates (except
for an npz file without ``train_keys``, which the results say).

Sources:
  model      indexer traces of the project's model (random init) on a synthetic NIAH prompt;
             codebooks per CSA layer from the traces of a second prompt (another seed).
  synthetic  clustered, heavy-tailed keys and cluster-focused queries (``synthetic_data``).
  npz        a user file (``load_npz``): keys [N, D], queries [Q, H, D], weights [Q, H],
             optional lengths [Q] and train_keys [N', D].
History length L: queries whose eligible length is >= L are sampled (at most max_queries, seeded)
and see the first L keys. Lengths that no query reaches are skipped and recorded.

Result cells: source, layer (model: the layer id or 'pooled'; else null), history, method,
num_candidates (direct_pq: k), c_over_k, filter_offset, recall_mean, recall_min, num_queries,
kept_mean and fetched_mean (candidates kept by the miss filter and exact keys read; direct_pq
keeps no candidates (null) and reads no exact key (0)).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
import zipfile

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import pyplot, run_dir, write_results
from lsparse_jax.config import ModelConfig
from lsparse_jax.indexing import coarse_to_fine as c2f
from lsparse_jax.indexing import index_scores, topk_positions
from lsparse_jax.model import init_params
from lsparse_jax.model.traces import indexer_traces
from lsparse_jax.quant import pq
from lsparse_jax.tasks import niah_example


@dataclasses.dataclass
class Problem:
    """One set of keys with the queries that search it (a model layer, or a whole source)."""

    layer: int | None
    queries: np.ndarray  # [Q, H, D] f32
    weights: np.ndarray  # [Q, H] f32
    keys: np.ndarray  # [N, D] f32 (evaluated)
    lengths: np.ndarray  # [Q] int32 eligible keys per query, in [1, N]
    train_keys: np.ndarray  # [N', D] f32 (codebook training)


@dataclasses.dataclass
class Source:
    name: str
    top_k: int
    candidates: tuple[int, ...]
    histories: tuple[int, ...]
    max_queries: int
    seed: int
    problems: list[Problem]
    info: dict


# ------------------------------------------------------------------------------ evaluation core


@functools.partial(jax.jit, static_argnames=("top_k", "candidates", "offsets"))
def _evaluate_chunk(q, w, keys, codes, codebooks, *, top_k, candidates, offsets):
    """Per query of q [B, H, D], w [B, H] over keys [L, D] (all eligible) -> direct recall [B],
    c2f recall, kept, fetched [B, len(candidates), len(offsets)]."""
    n = keys.shape[0]
    eligible = jnp.ones((n,), bool)
    cached = jnp.zeros((n,), bool)  # empty GPU key cache: every kept candidate is fetched
    tail = jnp.zeros((0,), jnp.int32)  # no exact tail: the coarse pass covers the history

    def one(qi, wi):
        exact = topk_positions(index_scores(qi, wi, keys), eligible, top_k)[0]
        coarse = pq.coarse_scores(qi, wi, codes, codebooks)  # codes are unbatched: decoded once
        direct = c2f.recall(topk_positions(coarse, eligible, top_k)[0], exact)

        def exact_scores(retained):  # every exact key is in memory here
            return index_scores(qi, wi, keys[jnp.maximum(retained, 0)]), None

        rec, kept, fetched = [], [], []
        for c in candidates:
            # step 1, top-C of the coarse scores: what the pq_topc op computes in serving
            cand, cand_scores = topk_positions(coarse, eligible, c)
            for off in offsets:
                sel, st, _ = c2f.coarse_to_fine(cand, cand_scores, cached[jnp.maximum(cand, 0)],
                                                tail, exact_scores, top_k=top_k,
                                                filter_offset=off)
                rec.append(c2f.recall(sel, exact))
                kept.append(st["kept"])
                fetched.append(st["fetched"])
        shape = (len(candidates), len(offsets))
        return (direct, jnp.stack(rec).reshape(shape), jnp.stack(kept).reshape(shape),
                jnp.stack(fetched).reshape(shape))

    return jax.vmap(one)(q, w)


def evaluate(queries, weights, keys, codes, codebooks, *, top_k: int, candidates, offsets,
             chunk: int = 32) -> dict[str, np.ndarray]:
    """Recall of every query against the exact top-k over all of ``keys``, in query chunks.

    queries [Q, H, D], weights [Q, H], keys [L, D], codes [L, M] uint8, codebooks [M, K, D/M].
    Returns numpy arrays: direct [Q]; c2f, kept, fetched [Q, len(candidates), len(offsets)].
    """
    candidates, offsets = tuple(int(c) for c in candidates), tuple(offsets)
    num = len(queries)
    chunk = max(1, min(chunk, num))
    keys, codes, codebooks = jnp.asarray(keys), jnp.asarray(codes), jnp.asarray(codebooks)
    parts = []
    for s in range(0, num, chunk):
        qb, wb = queries[s:s + chunk], weights[s:s + chunk]
        valid = len(qb)
        if valid < chunk:  # pad the last chunk (repeat a row) so one compilation serves all
            qb = np.concatenate([qb, np.repeat(qb[:1], chunk - valid, 0)])
            wb = np.concatenate([wb, np.repeat(wb[:1], chunk - valid, 0)])
        out = _evaluate_chunk(jnp.asarray(qb, jnp.float32), jnp.asarray(wb, jnp.float32), keys,
                              codes, codebooks, top_k=top_k, candidates=candidates,
                              offsets=offsets)
        parts.append([np.asarray(x)[:valid] for x in out])
    names = ("direct", "c2f", "kept", "fetched")
    return {n: np.concatenate([p[i] for p in parts]) for i, n in enumerate(names)}


def pq_shape(dim: int, train_count: int, pq_subdim: int, num_centroids: int) -> tuple[int, int]:
    """(M subspaces, K centroids) for keys of ``dim`` with ``train_count`` training keys."""
    if dim % pq_subdim:
        raise ValueError(f"recall_study: key dim D={dim} is not a multiple of "
                         f"pq_subdim={pq_subdim}")
    return dim // pq_subdim, min(num_centroids, train_count)


# --------------------------------------------------------------------------------------- sources


_init_params = jax.jit(init_params, static_argnums=(0, 1))  # one compile beats eager init


@gin.configurable
def recall_model(model: ModelConfig = gin.REQUIRED, prompt_tokens: int = 9216,
                 num_needles: int = 4, seed: int = 0, train_seed: int = 1,
                 prefill_chunk: int = 512, top_k: int | None = None,
                 candidates=(16, 32, 64, 128, 256), histories=(512, 1024, 2048),
                 max_queries: int = 256, checkpoint: str | None = None,
                 train_prompts: int = 1) -> Source:
    """Traces of every CSA layer on niah_example(seed); codebooks from the keys of
    ``train_prompts`` prompts niah_example(train_seed + j), j = 0 .. train_prompts - 1.

    Model weights: the trained ``checkpoint`` (lsparse_jax.training.save_params directory), or
    random init from ``seed`` when None. top_k None = the model's indexer top-k.
    Both prompts use seeds below TRAIN_SEED_BASE, so a trained model never saw them.
    """
    for setting, value in (("prompt_tokens", prompt_tokens), ("num_needles", num_needles),
                           ("prefill_chunk", prefill_chunk), ("max_queries", max_queries),
                           ("train_prompts", train_prompts)):
        v.integer(f"recall_model.{setting}", value)
    v.integer("recall_model.seed", seed, lo=0)
    v.integer("recall_model.train_seed", train_seed, lo=0)
    v.optional_integer("recall_model.top_k", top_k)
    v.integers("recall_model.candidates", candidates)
    v.integers("recall_model.histories", histories)
    if checkpoint is not None:
        checkpoint = v.checkpoint_path("recall_model.checkpoint", checkpoint)
    if train_seed <= seed < train_seed + train_prompts:
        raise ValueError("recall_model: the seeds train_seed .. train_seed + train_prompts - 1 "
                         "must not include seed (codebooks are trained on other prompts than "
                         "the evaluated one)")
    cfg = v.fit_model(model, prompt_tokens, "recall_model.prompt_tokens")
    if checkpoint is None:
        params = _init_params(cfg, seed)
    else:
        params = v.load_checkpoint("recall_model.checkpoint", checkpoint, cfg)
    evaluated = indexer_traces(params, cfg, niah_example(prompt_tokens, num_needles=num_needles,
                                                       seed=seed).prompt, prefill_chunk)
    training = [indexer_traces(params, cfg, niah_example(
        prompt_tokens, num_needles=num_needles, seed=train_seed + j).prompt, prefill_chunk)
        for j in range(train_prompts)]
    problems = []
    for i, ev in enumerate(evaluated):
        eligible = ev.lengths >= 1  # the first queries see no completed entry yet
        train_keys = np.concatenate([traces[i].keys for traces in training])
        problems.append(Problem(ev.layer, ev.queries[eligible], ev.weights[eligible], ev.keys,
                                ev.lengths[eligible], train_keys))
    info = {"model": cfg.__dict__ | {"indexer": cfg.indexer.__dict__},
            "prompt_tokens": prompt_tokens, "prompt_seed": seed, "train_prompt_seed": train_seed,
            "train_prompts": train_prompts,
            "weights": f"random init, seed {seed}" if checkpoint is None else
            f"trained checkpoint {checkpoint}", "layers": [p.layer for p in problems],
            "codebook_training": f"per-layer, on the keys of niah_example(seed={train_seed} .. "
                                 f"{train_seed + train_prompts - 1})"}
    return Source("model", top_k or cfg.indexer.top_k, tuple(candidates), tuple(histories),
                  max_queries, seed, problems, info)


def synthetic_data(num_keys: int, num_queries: int, dim: int, heads: int, *, clusters: int,
                   df: float, seed: int, sample_seed, segment: int = 256,
                   clusters_per_segment: int = 4, focus: int = 3, noise: float = 0.5):
    """Keys, queries and head weights with the structure of an indexer's inputs.

    The generator (centers, per-dim scales, shared offset) comes from ``seed``; draws from
    ``sample_seed`` (so codebook training keys share the distribution, not the samples).
    keys:    offset + centers[z] + noise * s * t_df, per-dim scale s log-normal (a few wide
             channels) and Student-t noise (heavy tails); z runs in segments of ~``segment``
             keys, each mixing ``clusters_per_segment`` clusters (topics), all from ``clusters``.
    queries: head h mixes the centers of ``focus`` clusters present in the history with random
             positive gains, plus Gaussian noise; weights w_h ~ N(0.25, 1) / sqrt(H) (both signs).
    Returns (keys [N, D], queries [Q, H, D], weights [Q, H]) f32.
    """
    g = np.random.default_rng(seed)
    centers = g.standard_normal((clusters, dim))
    scale = np.exp(0.5 * g.standard_normal(dim))
    offset = 0.5 * g.standard_normal(dim)
    r = np.random.default_rng(sample_seed)
    z = np.empty(num_keys, np.int64)
    pos = 0
    while pos < num_keys:
        run = int(r.geometric(1 / segment))
        topic = r.choice(clusters, clusters_per_segment, replace=False)
        z[pos:pos + run] = r.choice(topic, min(run, num_keys - pos))
        pos += run
    keys = offset + centers[z] + noise * scale * r.standard_t(df, (num_keys, dim))
    present = np.unique(z)
    picks = r.choice(present, (num_queries, focus))
    gains = np.abs(r.standard_normal((num_queries, heads, focus)))
    queries = np.einsum("qhf,qfd->qhd", gains, centers[picks])
    queries += noise * r.standard_normal(queries.shape)
    weights = (0.25 + r.standard_normal((num_queries, heads))) / np.sqrt(heads)
    return keys.astype(np.float32), queries.astype(np.float32), weights.astype(np.float32)


@gin.configurable
def recall_synthetic(num_keys: int = 16384, num_train_keys: int = 8192, num_queries: int = 256,
                     dim: int = 128, heads: int = 16, clusters: int = 64, df: float = 3.0,
                     seed: int = 0, train_seed: int = 1, top_k: int = 128,
                     candidates=(128, 256, 512, 1024, 2048), histories=(4096, 16384),
                     max_queries: int = 256) -> Source:
    """Synthetic keys and queries; every query may see all ``num_keys`` keys."""
    for setting, value in (("num_keys", num_keys), ("num_train_keys", num_train_keys),
                           ("num_queries", num_queries), ("dim", dim), ("heads", heads),
                           ("clusters", clusters), ("top_k", top_k),
                           ("max_queries", max_queries)):
        v.integer(f"recall_synthetic.{setting}", value)
    v.number("recall_synthetic.df", df, lo=1e-6)
    v.integers("recall_synthetic.candidates", candidates)
    v.integers("recall_synthetic.histories", histories)
    common = dict(dim=dim, heads=heads, clusters=clusters, df=df, seed=seed)
    # Draws are seeded by (seed, 1) and (train_seed, 2): the two never coincide.
    keys, queries, weights = synthetic_data(num_keys, num_queries, **common,
                                            sample_seed=(seed, 1))
    train, _, _ = synthetic_data(num_train_keys, 1, **common, sample_seed=(train_seed, 2))
    info = {"num_keys": num_keys, "num_train_keys": num_train_keys, "num_queries": num_queries,
            "dim": dim, "heads": heads, "clusters": clusters, "student_t_df": df, "seed": seed,
            "codebook_training": f"a separate draw of {num_train_keys} keys from the same "
                                 f"generator (sample seed ({train_seed}, 2))"}
    problem = Problem(None, queries, weights, keys, np.full(num_queries, num_keys, np.int32),
                      train)
    return Source("synthetic", top_k, tuple(candidates), tuple(histories), max_queries, seed,
                  [problem], info)


_NPZ_LAYOUT = ("keys [N, D], queries [Q, H, D], weights [Q, H]; optional lengths [Q] (ints in "
               "[1, N]) and train_keys [N', D]")


def load_npz(path) -> dict:
    """Loads and validates a user's recall-study file; raises ValueError naming the bad array.

    Returns {keys, queries, weights: f32 arrays, lengths: int32 [Q] (default N),
    train_keys: f32 [N', D] or None}.
    """
    path = pathlib.Path(path)
    where = f"recall npz {path}"
    if path.is_file() and not zipfile.is_zipfile(path):  # np.load would try pickle on a text file
        raise ValueError(f"{where}: cannot read the file: not an .npz archive (a zip of named "
                         f"arrays: {_NPZ_LAYOUT}; write one with numpy.savez)")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"{where}: cannot read the file ({err})") from err
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{where}: not an .npz archive of named arrays ({_NPZ_LAYOUT})")
    with archive:
        arrays = {}
        for name in ("keys", "queries", "weights", "lengths", "train_keys"):
            if name not in archive.files:
                if name in ("lengths", "train_keys"):
                    continue
                raise ValueError(f"{where}: missing array '{name}' (expected {_NPZ_LAYOUT})")
            try:
                arrays[name] = archive[name]
            except ValueError as err:  # object arrays need pickle, which we refuse
                raise ValueError(f"{where}: array '{name}' cannot be loaded ({err})") from err

    ndims = {"keys": 2, "queries": 3, "weights": 2, "lengths": 1, "train_keys": 2}
    out = {}
    for name, arr in arrays.items():
        if arr.ndim != ndims[name]:
            raise ValueError(f"{where}: array '{name}' must have {ndims[name]} dims, got shape "
                             f"{arr.shape}")
        if 0 in arr.shape:
            raise ValueError(f"{where}: array '{name}' is empty (shape {arr.shape})")
        if name == "lengths":
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{where}: array 'lengths' must hold integers, got dtype "
                                 f"{arr.dtype}")
            out[name] = arr
            continue
        if not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(f"{where}: array '{name}' must be floating point, got dtype "
                             f"{arr.dtype}")
        with np.errstate(over="ignore"):
            arr = arr.astype(np.float32)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{where}: array '{name}' contains NaN or inf (as float32)")
        out[name] = arr

    (n, d), (q, h, dq) = out["keys"].shape, out["queries"].shape
    if dq != d:
        raise ValueError(f"{where}: array 'queries' has head dim D={dq} but 'keys' have D={d}")
    if out["weights"].shape[0] != q:
        raise ValueError(f"{where}: array 'weights' has Q={out['weights'].shape[0]} rows but "
                         f"'queries' has Q={q}")
    if out["weights"].shape[1] != h:
        raise ValueError(f"{where}: array 'weights' has H={out['weights'].shape[1]} heads but "
                         f"'queries' has H={h}")
    lengths = out.get("lengths")
    if lengths is None:
        lengths = np.full(q, n, np.int32)
    elif lengths.shape[0] != q:
        raise ValueError(f"{where}: array 'lengths' has Q={lengths.shape[0]} entries but "
                         f"'queries' has Q={q}")
    elif lengths.min() < 1 or lengths.max() > n:
        raise ValueError(f"{where}: array 'lengths' must lie in [1, N={n}], got "
                         f"{lengths.min()}..{lengths.max()}")
    train = out.get("train_keys")
    if train is not None and train.shape[1] != d:
        raise ValueError(f"{where}: array 'train_keys' has D={train.shape[1]} but 'keys' have "
                         f"D={d}")
    return {"keys": out["keys"], "queries": out["queries"], "weights": out["weights"],
            "lengths": lengths.astype(np.int32), "train_keys": train}


@gin.configurable
def recall_npz(path=gin.REQUIRED, top_k: int = 512, candidates=(512, 1024, 2048, 4096),
               histories=None, max_queries: int = 256, seed: int = 0) -> Source:
    """A user's file (see ``load_npz``); a relative path resolves against the repository root.
    histories None = the longest, N."""
    v.integer("recall_npz.top_k", top_k)
    v.integer("recall_npz.max_queries", max_queries)
    v.integers("recall_npz.candidates", candidates)
    if histories is not None:
        v.integers("recall_npz.histories", histories)
    path = v.resolve_path("recall_npz.path", path, "file")
    try:
        data = load_npz(path)
    except ValueError as err:
        raise v.ConfigError(f"recall_npz.path: {err}") from err
    n = data["keys"].shape[0]
    info = {"path": str(path), "num_keys": n, "num_queries": int(data["queries"].shape[0])}
    train = data["train_keys"]
    if train is None:
        train = data["keys"]
        info["codebook_training"] = ("on the evaluated keys: the file has no train_keys, so "
                                     "recall is optimistic (codebooks have seen these keys)")
    else:
        info["codebook_training"] = f"on the file's train_keys ({len(train)} keys)"
    problem = Problem(None, data["queries"], data["weights"], data["keys"], data["lengths"],
                      train)
    return Source("npz", top_k, tuple(candidates), tuple(histories or (n,)), max_queries, seed,
                  [problem], info)


SOURCES = {"model": recall_model, "synthetic": recall_synthetic, "npz": recall_npz}


# ---------------------------------------------------------------------------------- experiment


@gin.configurable
def recall_study(name: str, sources=("model", "synthetic"), filter_offsets=(None, 1.0, 0.5),
                 pq_subdim: int = 4, num_centroids: int = 256, pq_iters: int = 20,
                 query_chunk: int = 32, seed: int = 0):
    """Recall of the exact indexer top-k by direct PQ top-k and by coarse-to-fine selection."""
    began = time.perf_counter()
    offsets = check_settings(sources, filter_offsets, pq_subdim, num_centroids, pq_iters,
                             query_chunk, seed)
    loaded = {}
    for src_name in sorted(sources, key=lambda s: s == "model"):  # cheap sources fail first
        tqdm.write(f"recall: loading source {src_name!r}")
        src = SOURCES[src_name]()
        _check_source(src)
        loaded[src_name] = src
    loaded = [loaded[s] for s in sources]

    # Codebooks per problem (model: per layer), trained on keys that are never evaluated.
    coded = []
    for src in loaded:
        entries = []
        for p in src.problems:
            m, k = pq_shape(p.keys.shape[1], len(p.train_keys), pq_subdim, num_centroids)
            cb = pq.train_codebooks(p.train_keys, m, k, iters=pq_iters, seed=seed)
            entries.append((p, cb, pq.encode(p.keys, cb)))
            src.info.setdefault("pq", []).append({
                "layer": p.layer, "num_subspaces": m, "num_centroids": k, "subvector_dim":
                pq_subdim, "train_keys": len(p.train_keys), "code_bytes": m,
                "note": (f"K={k} < {num_centroids}: only {len(p.train_keys)} training keys"
                         if k < num_centroids else "")})
            tqdm.write(f"recall: {src.name} layer {p.layer}: PQ M={m} K={k} trained on "
                       f"{len(p.train_keys)} keys")
        coded.append((src, entries))

    cells = []
    with tqdm(total=sum(len(s.histories) for s in loaded), desc="recall", unit="cell") as bar:
        for src, entries in coded:
            src.info["skipped_histories"] = []
            for hist in src.histories:
                bar.set_postfix(source=src.name, history=hist)
                got = []
                for p, cb, codes in entries:
                    pool = np.flatnonzero(p.lengths >= hist)
                    if hist > len(p.keys) or not len(pool):
                        continue
                    rng = np.random.default_rng((src.seed, hist))
                    pick = np.sort(rng.choice(pool, min(src.max_queries, len(pool)),
                                              replace=False))
                    res = evaluate(p.queries[pick], p.weights[pick], p.keys[:hist],
                                   codes[:hist], cb, top_k=src.top_k, candidates=src.candidates,
                                   offsets=offsets, chunk=query_chunk)
                    got.append((p.layer, res))
                if not got:
                    longest = max(int(p.lengths.max()) for p in src.problems)
                    src.info["skipped_histories"].append(
                        {"history": hist, "reason": f"no query has >= {hist} eligible keys "
                                                    f"(longest: {longest})"})
                elif len(got) > 1:  # model: also pool the layers' queries
                    got.append(("pooled", {k: np.concatenate([r[k] for _, r in got])
                                           for k in got[0][1]}))
                for layer, res in got:
                    cells += _cells(src, layer, hist, res, offsets)
                bar.update(1)

    table = format_table(cells)
    headline = _headline(cells, loaded)
    print(table)
    for src_name, h in headline.items():
        print(f"{src_name} (history {h['history']}, k={h['top_k']}, {h['num_queries']} queries): "
              f"direct_pq {h['direct_pq']:.4f}; " + "; ".join(
                  f"c2f {c} {f} {v:.4f}" for c, row in h["c2f"].items() for f, v in row.items()))
    out = run_dir(name)
    results = {"sources": {s.name: {"top_k": s.top_k, "candidates": list(s.candidates),
                                    "histories": list(s.histories),
                                    "max_queries": s.max_queries, **s.info} for s in loaded},
               "filter_offsets": list(offsets), "pq_iters": pq_iters, "seed": seed,
               "cells": cells, "headline": headline, "table": table,
               "runtime_s": round(time.perf_counter() - began, 1)}
    path = write_results(out, results)
    plot(cells, [s.name for s in loaded], out / "recall.png")
    print(f"wrote {path} and {out / 'recall.png'} ({results['runtime_s']} s)")
    return results


def check_settings(sources, filter_offsets, pq_subdim, num_centroids, pq_iters, query_chunk,
                   seed) -> tuple:
    """Validates recall_study's settings (and that an npz source names a readable file) before
    any source is loaded; returns the filter offsets."""
    v.names("recall_study.sources", sources, tuple(SOURCES))
    offsets = v.sequence("recall_study.filter_offsets", filter_offsets, "(None, 1.0)")
    offsets = tuple(v.number("recall_study.filter_offsets", o, lo=0.0, none_ok=True)
                    for o in offsets)
    for setting, value in (("pq_subdim", pq_subdim), ("num_centroids", num_centroids),
                           ("pq_iters", pq_iters), ("query_chunk", query_chunk)):
        v.integer(f"recall_study.{setting}", value)
    v.integer("recall_study.seed", seed, lo=0)
    if "npz" in sources:
        if v.bound("recall_npz.path") is None:
            raise v.ConfigError("recall_npz.path is not set: the 'npz' source needs it, e.g. "
                                "--gin.recall_npz.path=\"'/path/to/traces.npz'\"")
        v.resolve_path("recall_npz.path", v.bound("recall_npz.path"), "file")
    return offsets


def _check_source(src: Source) -> None:
    def ints(name, values):
        if not values or any(isinstance(v, bool) or int(v) != v or v < 1 for v in values):
            raise ValueError(f"recall_study: {src.name} {name} must be ints >= 1, got {values}")

    ints("top_k", (src.top_k,))
    ints("candidates", src.candidates)
    ints("histories", src.histories)
    ints("max_queries", (src.max_queries,))


def _cells(src: Source, layer, hist: int, res: dict, offsets) -> list[dict]:
    base = {"source": src.name, "layer": layer, "history": hist,
            "num_queries": int(len(res["direct"]))}
    rows = [base | {"method": "direct_pq", "num_candidates": src.top_k, "c_over_k": 1.0,
                    "filter_offset": None, "recall_mean": float(res["direct"].mean()),
                    "recall_min": float(res["direct"].min()), "kept_mean": None,
                    "fetched_mean": 0.0}]
    for i, c in enumerate(src.candidates):
        for j, off in enumerate(offsets):
            r = res["c2f"][:, i, j]
            rows.append(base | {"method": "c2f", "num_candidates": c,
                                "c_over_k": c / src.top_k, "filter_offset": off,
                                "recall_mean": float(r.mean()), "recall_min": float(r.min()),
                                "kept_mean": float(res["kept"][:, i, j].mean()),
                                "fetched_mean": float(res["fetched"][:, i, j].mean())})
    return rows


def _summary_cells(cells: list[dict]) -> list[dict]:
    """Cells shown in the table and plot: model pooled over layers, other sources as they are."""
    pooled = {(c["source"], c["history"]) for c in cells if c["layer"] == "pooled"}
    return [c for c in cells if c["layer"] == "pooled" or (c["source"], c["history"]) not in pooled]


def _method(c: dict) -> str:
    if c["method"] == "direct_pq":
        return "direct_pq"
    return "c2f" if c["filter_offset"] is None else f"c2f@{c['filter_offset']:g}"


def format_table(cells: list[dict]) -> str:
    """One row per (source, history, method); columns: recall at each C/k (direct_pq: C = k).
    Model rows pool the layers."""
    shown = _summary_cells(cells)
    ratios = sorted({c["c_over_k"] for c in shown})
    keys = list(dict.fromkeys((c["source"], c["history"], _method(c)) for c in shown))
    value = {(c["source"], c["history"], _method(c), c["c_over_k"]): c["recall_mean"]
             for c in shown}
    head = ("source", "history", "method", *[f"C/k={r:g}" for r in ratios])
    rows = [head] + [(s, str(h), m, *[f"{value[(s, h, m, r)]:.4f}" if (s, h, m, r) in value
                                      else "" for r in ratios]) for s, h, m in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(r[i].rjust(widths[i]) for i in range(len(head))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _headline(cells: list[dict], sources: list[Source]) -> dict:
    """Per source, at its longest evaluated history: direct_pq and c2f at C = 4k and 8k."""
    out = {}
    shown = _summary_cells(cells)
    for src in sources:
        mine = [c for c in shown if c["source"] == src.name]
        if not mine:
            continue
        hist = max(c["history"] for c in mine)
        here = [c for c in mine if c["history"] == hist]
        direct = next(c for c in here if c["method"] == "direct_pq")
        entry = {"history": hist, "top_k": src.top_k, "num_queries": direct["num_queries"],
                 "direct_pq": direct["recall_mean"], "c2f": {}}
        for c in here:
            if c["method"] == "c2f" and c["c_over_k"] in (4.0, 8.0):
                off = c["filter_offset"]
                entry["c2f"].setdefault(f"C={c['c_over_k']:g}k", {})[
                    "filter off" if off is None else f"offset {off:g}"] = c["recall_mean"]
        out[src.name] = entry
    return out


def plot(cells: list[dict], sources: list[str], path) -> None:
    """Recall vs C (log2) per source: c2f per (history, filter offset), direct PQ dashed."""
    plt = pyplot()
    shown = _summary_cells(cells)
    fig, axes = plt.subplots(1, len(sources), figsize=(4.5 * len(sources), 3.6), squeeze=False)
    styles = ["-", "-.", ":", (0, (1, 3))]
    for ax, src in zip(axes[0], sources, strict=True):
        mine = [c for c in shown if c["source"] == src]
        hists = sorted({c["history"] for c in mine})
        offsets = list(dict.fromkeys(c["filter_offset"] for c in mine if c["method"] == "c2f"))
        for hi, hist in enumerate(hists):
            color = f"C{hi}"
            here = [c for c in mine if c["history"] == hist]
            direct = next(c for c in here if c["method"] == "direct_pq")
            ax.axhline(direct["recall_mean"], color=color, ls="--", lw=1,
                       label=f"L={hist} direct PQ")
            for oi, off in enumerate(offsets):
                line = sorted((c["num_candidates"], c["recall_mean"]) for c in here
                              if c["method"] == "c2f" and c["filter_offset"] == off)
                ax.plot(*zip(*line), color=color, ls=styles[oi % len(styles)], marker="o",
                        ms=3, label=f"L={hist} c2f " + ("no filter" if off is None
                                                        else f"offset {off:g}"))
        k = next((c["num_candidates"] for c in mine if c["method"] == "direct_pq"), "?")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{src} (k={k}{', layers pooled' if src == 'model' else ''})", fontsize=9)
        ax.set_xlabel("candidates C")
        ax.set_ylabel("recall of exact top-k")
        low = min([c["recall_mean"] for c in mine] or [0.0])
        ax.set_ylim(max(0.0, np.floor(10 * low - 0.5) / 10), 1.01)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
