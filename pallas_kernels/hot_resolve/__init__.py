"""``hot_resolve``: HiSparse hot-cache resolve of one request (hits, LRU victims, host copy).

Notation: k selected positions (-1 = nothing), B hot rows (k <= B), D values per row, P rows
per host page. Hits by a bounded [k, B] scan; misses take LRU victims (empty rows first) and
their rows are copied from the (pinned_host) pool; touched rows get stamp clock * k + rank.
See ``api.hot_resolve`` for the arguments and implementations.
"""

from pallas_kernels.hot_resolve.api import hot_resolve

__all__ = ["hot_resolve"]
