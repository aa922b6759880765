"""``topk``: exact top-k positions of long score rows under per-row lengths.

Positions n < lengths[b] of row b are eligible; entries past a row's length may hold anything
(NaN poison included) and never influence the result. Eligible scores must be finite or -inf:
NaN inside the length is unsupported input, which both implementations treat as -inf. -0.0
counts as +0.0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.topk import fused
from pallas_kernels.topk.reference import candidate_topk_xla, topk_xla
from pallas_kernels.topk.triton import topk_triton

AVAILABLE = ("xla", "triton", "triton_fused")
CANDIDATE_AVAILABLE = ("xla", "triton")
# What "triton" runs (H200, 64 x 262144, k = 2048, session 6): the one-read path with a
# 4096-position sample and the register finish, 0.191 ms; the two-read sequence 0.285 ms.
TRITON_OPTIONS = dict(one_read=True, sample=4096, finish_in_registers=True)
# What "triton_fused" runs (fused.py: the same one-read idea in two or three launches, no XLA
# glue): fused.fused_config's defaults plus these. H200, B 64, ms per call in a batch of 8
# (session 12, benchmarks/topk_launch_gpu.py): 262144 / k 2048 0.139 vs "triton" 0.170 and
# lax.top_k 2.103; 32768 / k 512 (the decode step's rows at 128K) 0.063 vs 0.127 and 0.310.
FUSED_OPTIONS: dict = {}


def _validate(scores, lengths, k):
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"topk: k must be a static int, got {k!r}")
    if k <= 0:
        raise ValueError(f"topk: k must be >= 1, got {k}")
    if jnp.ndim(scores) != 2:
        raise ValueError(f"topk: scores must be [B, N], got shape {jnp.shape(scores)}")
    if jnp.result_type(scores) != jnp.float32:
        raise ValueError(f"topk: scores must be float32, got {jnp.result_type(scores)}")
    if jnp.ndim(lengths) != 1 or jnp.shape(lengths)[0] != jnp.shape(scores)[0]:
        raise ValueError(f"topk: lengths must be [B] = [{jnp.shape(scores)[0]}], got shape "
                         f"{jnp.shape(lengths)}")
    if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
        raise ValueError(f"topk: lengths must be an integer array, got "
                         f"{jnp.result_type(lengths)}")


def topk(scores, lengths, k: int, *, implementation: str | None = None):
    """Exact top-k of each score row.

    scores [B, N] f32, lengths [B] int32, k static int >= 1 (may exceed N or a row's length)
    -> (positions [B, k] int32, values [B, k] f32). positions holds the set of the
    min(k, lengths[b]) eligible positions with the highest scores (among equal scores the lower
    positions win), in any order ("xla" gives best-first), then -1; values are aligned (-inf at
    -1). implementation: "xla", "triton" (Pallas lowered through Triton; interpret mode without
    a GPU), "triton_fused" (fused.py: two or three launches, the sample floor and the fallback
    in-kernel; a k too large for its register finish, see ``fused.fits``, runs "triton") or
    None (triton_fused on a GPU, xla elsewhere).
    """
    _validate(scores, lengths, k)
    k = int(k)
    impl = common.choose("topk", implementation, AVAILABLE, fastest_on_gpu="triton_fused")
    scores = jnp.asarray(scores)
    lengths = jnp.asarray(lengths).astype(jnp.int32)
    b, n = scores.shape
    if n == 0 or b == 0:
        return (jnp.full((b, k), -1, jnp.int32), jnp.full((b, k), -jnp.inf, jnp.float32))
    if impl == "triton_fused" and fused.fits(n, k):
        return fused.topk_fused(scores, lengths, k, interpret=common.interpret(), **FUSED_OPTIONS)
    if impl in ("triton", "triton_fused"):
        return topk_triton(scores, lengths, k, interpret=common.interpret(), **TRITON_OPTIONS)
    return topk_xla(scores, lengths, k)


def candidate_topk(scores, ids, k: int, *, implementation: str | None = None):
    """Exact top-k of short rows of scored ids (LeanSparse's miss filter and rerank: C coarse
    candidates, or the kept candidates and the tail, each with its position).

    scores [B, R] f32; ids [B, R] int32: -1 where an entry is not eligible (its score may be
    anything, NaN poison included), the eligible ids >= 0 and distinct within a row (a repeated
    id is unsupported input); k static int >= 1 (may exceed R). Rule: higher canonical score
    first (NaN -> -inf, -0.0 -> +0.0; an eligible -inf still wins over nothing), equal scores
    to the lower id. Returns (ids [B, k] int32: the min(k, #eligible) winners, in any order
    ("xla" best-first, "triton" in row order), then -1; values [B, k] f32 aligned, -inf at
    -1). implementation: "xla" (``reference.candidate_topk_xla``: one two-key sort a row),
    "triton" (``candidates.py``: one program a row, radix selection in registers; interpret
    mode without a GPU; rows up to a few thousand entries) or None (triton on a GPU, xla
    elsewhere).
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"candidate_topk: k must be a static int >= 1, got {k!r}")
    impl = common.choose("candidate_topk", implementation, CANDIDATE_AVAILABLE,
                         fastest_on_gpu="triton")
    scores, ids = jnp.asarray(scores), jnp.asarray(ids)
    if scores.ndim != 2 or ids.shape != scores.shape:
        raise ValueError(f"candidate_topk: scores and ids must both be [B, R], got shapes "
                         f"{scores.shape} and {ids.shape}")
    if scores.dtype != jnp.float32:
        raise ValueError(f"candidate_topk: scores must be float32, got {scores.dtype}")
    if ids.dtype != jnp.int32:
        raise ValueError(f"candidate_topk: ids must be int32, got {ids.dtype}")
    b, r = scores.shape
    if b == 0 or r == 0:
        return jnp.full((b, int(k)), -1, jnp.int32), jnp.full((b, int(k)), -jnp.inf)
    if impl == "triton":
        from pallas_kernels.topk.candidates import candidate_topk_triton

        return candidate_topk_triton(scores, ids, k=int(k))
    return candidate_topk_xla(scores, ids, int(k))
