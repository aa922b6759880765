"""``index_logits``: the lightning indexer's logits of T queries against N shared keys (the
prefill's exact selection), without materializing the per-head products.

Notation: T queries, H heads, D head dim, N keys.
logits [T, N] = sum_h w[t, h] ReLU(q[t, h] . k[n]), operands rounded to bf16, f32 sums.
See ``api.index_logits`` for the arguments and implementations.
"""

from pallas_kernels.index_logits.api import index_logits

__all__ = ["index_logits"]
