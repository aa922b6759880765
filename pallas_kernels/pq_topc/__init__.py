"""``pq_topc``: coarse PQ scores of each request's history and its top-C positions."""

from pallas_kernels.pq_topc.api import pq_topc

__all__ = ["pq_topc"]
