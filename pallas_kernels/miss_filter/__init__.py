"""LeanSparse's miss filter (``miss_filter``): XLA reference and a Pallas-Triton kernel."""

from pallas_kernels.miss_filter.api import miss_filter

__all__ = ["miss_filter"]
