"""Exact top-k of long score rows (``topk``): XLA reference and a Pallas-Triton kernel."""

from pallas_kernels.topk.api import topk

__all__ = ["topk"]
