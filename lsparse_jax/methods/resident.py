"""``resident``: the reference method, every compressed row and indexer key on the device
(``methods.base.Method`` is its policy; this module registers it)."""

from lsparse_jax.methods.base import Method, register

Resident = register(Method)

__all__ = ["Resident"]
