"""lsparse-jax: sparse-attention LLM serving over a GPU/host KV hierarchy (LeanSparse, Adaptive
DHiSparse, HiSparse and fully resident serving in one engine).

Importing the package registers the built-in serving methods (``lsparse_jax.methods``), so
that ``EngineConfig(method=...)`` knows them.
"""

from lsparse_jax import methods  # noqa: F401  (registers the built-in methods)
