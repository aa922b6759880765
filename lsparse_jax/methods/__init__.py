"""Serving methods as policies: one module per method, each a ``methods.base.Method``.

``policy(engine)`` returns the policy value of ``engine.method``; importing this package
registers the built-in methods (resident, hisparse, leansparse, adaptive, direct_pq).
"""

from lsparse_jax.methods import adaptive, direct_pq, hisparse, leansparse, resident  # noqa: F401
from lsparse_jax.methods.base import Controller, Grant, Method, policy, register
from lsparse_jax.methods.leansparse import calibrate_codebooks

__all__ = ["Controller", "Grant", "Method", "calibrate_codebooks", "policy", "register"]
