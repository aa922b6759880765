"""Decode/prefill attention over gathered rows with an attention sink."""

import jax
import jax.numpy as jnp

from lsparse_jax.model.layers import HIGHEST


def sink_attention(q, groups, sink):
    """Softmax attention of queries over several row groups plus a per-head sink.

    Notation: T queries, H heads, D dim; group g has S_g rows that serve as keys and values
      (a compressed entry is both, as in DeepSeek-V4's single KV head).
    q [T, H, D]; groups: list of (rows [T or 1, S_g, D], mask [T, S_g]); sink [H] logits.
    Math: logits_{t,h,s} = q_{t,h} . r_s / sqrt(D) over the unmasked rows of all groups; the sink
      adds exp(sink_h) to the softmax denominator and contributes no value.
    Masked rows are never read (they may hold NaN poison). Returns [T, H, D] f32.
    """
    scale = q.shape[-1] ** -0.5
    q = q.astype(jnp.float32)
    logits, values = [], []
    for rows, mask in groups:
        rows = jnp.where(mask[..., None], rows.astype(jnp.float32), 0.0)
        rows = jnp.broadcast_to(rows, (q.shape[0],) + rows.shape[1:])
        lg = jnp.einsum("thd,tsd->ths", q, rows, precision=HIGHEST) * scale
        logits.append(jnp.where(mask[:, None, :], lg, -jnp.inf))
        values.append(rows)
    sink_logit = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None],
                                  (q.shape[0], q.shape[1], 1))
    logits = jnp.concatenate(logits + [sink_logit], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)[..., :-1]
    values = jnp.concatenate(values, axis=1)
    return jnp.einsum("ths,tsd->thd", probs, values, precision=HIGHEST)
