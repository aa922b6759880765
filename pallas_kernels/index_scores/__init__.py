"""``index_scores``: exact LeanSparse rescoring of C gathered FP8 candidate keys per request.

Notation: B requests, H heads, D head dim, C candidates, NB scale blocks per key.
scores [B, C] = sum_h w_h ReLU(q_h . dequant(k_c)), -inf for invalid candidates.
See ``api.index_scores`` for the arguments and implementations.
"""

from pallas_kernels.index_scores.api import index_scores, index_scores_paged, index_topk

__all__ = ["index_scores", "index_scores_paged", "index_topk"]
