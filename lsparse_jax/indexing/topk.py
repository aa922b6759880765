"""Top-k selection of eligible positions with the project's tie and padding rule (the XLA
reference of the ``topk`` op is its definition)."""

from pallas_kernels.topk.reference import topk_positions

__all__ = ["topk_positions"]
