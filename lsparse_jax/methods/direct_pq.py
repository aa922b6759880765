"""``direct_pq``: the baseline LeanSparse argues against, top-k straight from PQ coarse scores.

Placement as ``leansparse``; the selection is its coarse pass with C = k and no miss filter,
so the exact rescoring only orders the k coarse winners and never changes the set.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lsparse_jax.methods.base import register
from lsparse_jax.methods.leansparse import CoarseToFineIndex, LeanSparse


@register
@dataclasses.dataclass(frozen=True)
class DirectPQ(LeanSparse):
    name: ClassVar[str] = "direct_pq"

    def key_index(self) -> CoarseToFineIndex:
        index = super().key_index()
        direct = dataclasses.replace(index.settings, num_candidates=index.top_k,
                                     miss_filter_offset=None)
        return dataclasses.replace(index, settings=direct)


__all__ = ["DirectPQ"]
