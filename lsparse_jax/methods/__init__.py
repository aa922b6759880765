"""Serving methods as policies: one module per method, each a ``methods.base.Method``.

``policy(engine)`` returns the policy value of ``engine.method``; importing this package
registers the built-in methods (resident, hisparse, leansparse, adaptive, direct_pq,
echo).
"""

from lsparse_jax.methods import (  # noqa: F401
    adaptive,
    direct_pq,
    echo,
    hisparse,
    leansparse,
    resident,
)
from lsparse_jax.methods.base import Controller, Grant, Method, policy, register
from lsparse_jax.methods.leansparse import calibrate_codebooks

__all__ = ["Controller", "Grant", "Method", "calibrate_codebooks", "policy", "register"]
