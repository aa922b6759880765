"""``sparse_attention``: decode attention over K selected table rows, W window rows and a sink.

Notation: S requests, H heads, D head dim, R table rows, K selected slots (-1 = none), W window
rows. out[s, h] = sum_r exp(q_{s,h} . r / sqrt(D)) r / (exp(sink_h) + sum_r exp(...)) over the
valid rows r. See ``api.sparse_attention`` for the arguments and implementations.
"""

from pallas_kernels.sparse_attention.api import sparse_attention

__all__ = ["sparse_attention"]
