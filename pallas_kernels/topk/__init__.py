"""Exact top-k of long score rows (``topk``) and of short rows of scored ids
(``candidate_topk``): XLA references and Pallas-Triton kernels."""

from pallas_kernels.topk.api import candidate_topk, topk

__all__ = ["candidate_topk", "topk"]
