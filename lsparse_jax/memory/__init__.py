"""The KV hierarchy's stores: host page pool, hot cache, paged KV and keys, accounting."""

from lsparse_jax.memory.host_pool import (
    HostCapacityError,
    PageAllocator,
    empty_pool,
    read_host_rows,
    write_host_page,
)
from lsparse_jax.memory.hot_cache import HotCache, resolve
from lsparse_jax.memory.key_store import KeyPageView, PagedKeys
from lsparse_jax.memory.paged_kv import PagedKV, PagedKVStore, PageView

__all__ = ["HostCapacityError", "PageAllocator", "empty_pool", "read_host_rows",
           "write_host_page", "HotCache", "resolve", "KeyPageView", "PagedKeys", "PagedKV",
           "PagedKVStore", "PageView"]
