"""Greedy and seeded temperature sampling."""

import jax
import jax.numpy as jnp


def sample(logits: jnp.ndarray, rng, temperature: float) -> jnp.ndarray:
    """logits [B, V] -> tokens [B] int32. temperature 0 is argmax (ties to the lower id)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)
