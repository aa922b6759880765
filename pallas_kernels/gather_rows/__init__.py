"""``gather_rows``: rows of a device or pinned_host table, selected by id, copied to the device.

Notation: N table rows, D values per row, n ids; rows[j] = table[ids[j]], NaN where ids[j] < 0.
See ``api.gather_rows`` for the arguments and implementations.
"""

from pallas_kernels.gather_rows.api import gather_rows

__all__ = ["gather_rows"]
