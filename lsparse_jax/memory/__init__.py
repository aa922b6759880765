"""The KV hierarchy: host page pool, hot cache, KV stores, accounting."""

from lsparse_jax.memory.host_pool import (
                                          HostCapacityError,
                                          PageAllocator,
                                          empty_pool,
                                          read_host_rows,
                                          write_host_page,
)
from lsparse_jax.memory.hot_cache import HotCache, resolve
from lsparse_jax.memory.kv_store import HostView, PagedKV, ResidentKV

__all__ = ["HostCapacityError", "PageAllocator", "empty_pool", "read_host_rows",
           "write_host_page", "HotCache", "resolve", "HostView", "PagedKV", "ResidentKV"]
