"""Decode/prefill attention over gathered rows with an attention sink."""

import jax
import jax.numpy as jnp

from lsparse_jax.model.layers import precision


def sink_attention(q, groups, sink, return_probs: bool = False):
    """Softmax attention of queries over several row groups plus a per-head sink.

    Notation: T queries, H heads, D dim; group g has S_g rows that serve as keys and values
      (a compressed entry is both, as in DeepSeek-V4's single KV head).
    q [T, H, D]; groups: list of (rows [T or 1, S_g, D], mask [T, S_g]); sink [H] logits.
    Math: logits_{t,h,s} = q_{t,h} . r_s / sqrt(D) over the unmasked rows of all groups; the sink
      adds exp(sink_h) to the softmax denominator and contributes no value.
    Masked rows are never read (they may hold NaN poison). Returns [T, H, D] f32, and with
    ``return_probs`` also the attention probabilities of each group, a list of [T, H, S_g].
    """
    scale = q.shape[-1] ** -0.5
    q = q.astype(jnp.float32)
    logits, values = [], []
    for rows, mask in groups:
        rows = rows.astype(jnp.float32)
        if rows.shape[0] == 1:  # rows shared by every query: never broadcast them to [T, S, D]
            # a row no query may read is zeroed (it may be NaN); rows some query may read are
            # real data, and a query's masked logits give them probability 0
            rows = jnp.where(jnp.any(mask, axis=0)[:, None], rows[0], 0.0)
            lg = jnp.einsum("thd,sd->ths", q, rows, precision=precision()) * scale
        else:
            rows = jnp.where(mask[..., None], rows, 0.0)
            lg = jnp.einsum("thd,tsd->ths", q, rows, precision=precision()) * scale
        logits.append(jnp.where(mask[:, None, :], lg, -jnp.inf))
        values.append(rows)
    sink_logit = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None],
                                  (q.shape[0], q.shape[1], 1))
    probs = jax.nn.softmax(jnp.concatenate(logits + [sink_logit], axis=-1), axis=-1)
    bounds = [0]
    for lg in logits:
        bounds.append(bounds[-1] + lg.shape[-1])
    group_probs = [probs[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    out = 0.0
    for p, rows in zip(group_probs, values):
        spec = "ths,sd->thd" if rows.ndim == 2 else "ths,tsd->thd"
        out = out + jnp.einsum(spec, p, rows, precision=precision())
    return (out, group_probs) if return_probs else out
