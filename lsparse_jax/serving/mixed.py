"""The mixed step (Sarathi-style): one jitted program runs the decode step of every slot and
one chunk of a prefill, the per-token work of both over one concatenated batch.

Notation: S slots (one decode token each), T chunk tokens (the first ``num_valid`` real).
Per layer: x_d [S, 1, hidden] go through ``Block.attend`` mapped over slots with the method's
stores (as ``steps.decode_step``), x_c [T, hidden] through ``Block.attend`` with the resident
stores (as ``steps.forward_chunk``); then ``Block.feed_forward`` (norm + MLP GEMMs) runs once
over [x_d ; x_c] [S + T, hidden]: the decode rows ride on the chunk's weight reads. The final
norm + LM head likewise. Rows do not mix outside attention, so each row's result is the
separate programs' (tested bit for bit on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lsparse_jax.config import EngineConfig
from lsparse_jax.methods import policy
from lsparse_jax.model.transformer import Head, Transformer, shared_selection
from lsparse_jax.serving.state import DecodeState
from lsparse_jax.serving.steps import decode_model, sample_step, step_selections


def check_mixed(engine: EngineConfig) -> None:
    """Refuses the engines a mixed step cannot serve."""
    if engine.tp != 1:
        raise ValueError(f"mixed step: tp={engine.tp}; it runs on one device (tp=1)")
    if engine.cache.streamed_prefill:
        raise ValueError("mixed step: CacheConfig.streamed_prefill streams a chunk through the "
                         "layers with its state on the host; the mixed step runs the "
                         "monolithic prefill's chunk")


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def mixed_step(params, engine: EngineConfig, state: DecodeState, tokens, active, pre_caches,
               chunk_tokens, start, num_valid):
    """``steps.decode_step(params, engine, state, tokens, active)`` (tp = 1: no head mesh) and
    ``steps.forward_chunk(params, cfg, pre_caches, chunk_tokens, start, num_valid)`` in one
    program -> (state, DecodeOutput, (chunk logits [T, V], pre_caches))."""
    check_mixed(engine)
    cfg, method, s = engine.model, policy(engine), tokens.shape[0]
    dec, pre = decode_model(engine), Transformer(cfg, implementation=engine.implementation)
    rows = method.slot_rows(state.tier)
    x = dec.embedding().apply({"params": params["embed"]},
                              jnp.concatenate([tokens, chunk_tokens]))
    x_d, x_c = x[:s, None], x[s:]
    caches_d, caches_c, sels_d, sels_c = [], [], [], []
    for i in range(cfg.num_layers):
        layer = {"params": params[f"block_{i}"]}

        def attend_slot(x, caches, length, live, shared, slot_rows, i=i, layer=layer):
            # the method's shared state is closed over, its per-slot rows mapped (decode_step)
            contexts = method.contexts(state.tier, slot_rows)
            return dec.block(i).apply(layer, x, caches, length, live.astype(jnp.int32), shared,
                                      None if contexts is None else contexts[i],
                                      method="attend")

        x_d, c, sel = jax.vmap(attend_slot)(x_d, state.caches[i], state.lengths, active,
                                            shared_selection(cfg, i, sels_d), rows)
        caches_d.append(c)
        sels_d.append(sel)
        x_c, c, sel = pre.block(i).apply(layer, x_c, pre_caches[i], start, num_valid,
                                         shared_selection(cfg, i, sels_c), method="attend")
        caches_c.append(c)
        sels_c.append(sel)
        x = pre.block(i).apply(layer, jnp.concatenate([x_d[:, 0], x_c]), method="feed_forward")
        x_d, x_c = x[:s, None], x[s:]
    logits = Head(cfg).apply({"params": params}, jnp.concatenate([x_d[:, 0], x_c]))
    picked = jax.vmap(functools.partial(step_selections, cfg))(tuple(sels_d))
    state, out = sample_step(engine, state, logits[:s], tuple(caches_d), active, picked)
    return state, out, (logits[s:], tuple(caches_c))


__all__ = ["check_mixed", "mixed_step"]
