"""A DFlash-style block drafter over a ring window of target features.

The drafter proposes gamma tokens in one non-causal forward of a block
[last accepted token, MASK x gamma] at positions L .. L+gamma. It is conditioned on the target:
the hidden states of a few target layers at each committed position are concatenated,
projected and normalised into a context feature, and every draft layer attends to its own
keys/values of those features (the "extra keys/values") besides the block's. A draft layer sees
only the W newest committed positions: at serving time it keeps their keys/values (or their
features, ``DrafterConfig.ring``) in a ring buffer of fixed shape (``DrafterWindow``, position q
at slot q % W; never offloaded). The
drafter reads the target's embedding table and LM head (frozen) and owns everything else.

Parameters are a plain pytree (``init_drafter``); all functions are pure and per slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import DrafterConfig, ModelConfig
from lsparse_jax.model.layers import HIGHEST, rope

ROPE_THETA = 10000.0


def _rms(x, scale, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST)


def init_drafter(cfg: ModelConfig, dcfg: DrafterConfig, seed: int = 0) -> dict:
    """Random drafter parameters (lecun-normal projections, unit norms)."""
    dcfg.check(cfg)
    h, f, inner = cfg.hidden, dcfg.mlp_hidden, dcfg.num_heads * dcfg.head_dim
    keys = iter(jax.random.split(jax.random.key(seed), 8 * dcfg.num_layers + 4))

    def w(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * n_in ** -0.5

    layers = [dict(attn_norm=jnp.ones(h), wq=w(h, inner), wk=w(h, inner), wv=w(h, inner),
                   wo=w(inner, h), mlp_norm=jnp.ones(h), gate=w(h, f), up=w(h, f),
                   down=w(f, h)) for _ in range(dcfg.num_layers)]
    return dict(fc=w(len(dcfg.target_layers) * h, h), ctx_norm=jnp.ones(h),
                mask=jax.random.normal(next(keys), (h,), jnp.float32),
                final_norm=jnp.ones(h), layers=layers)


def target_io(params) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The target's (embedding table [V, H], LM head [H, V]) that the drafter shares."""
    return params["embed"]["embedding"], params["lm_head"]["kernel"]


def _heads(x, dcfg: DrafterConfig):
    return x.reshape(x.shape[:-1] + (dcfg.num_heads, dcfg.head_dim))


def context_features(dparams, hidden):
    """c = RMSNorm(concat_L(hidden) W_fc): [n, H] f32 from target hidden states [n, n_L, H]."""
    return _rms(_dot(hidden.reshape(hidden.shape[0], -1), dparams["fc"]), dparams["ctx_norm"])


def feature_kv(dparams, dcfg: DrafterConfig, c, positions):
    """Each draft layer's keys and values of features c [n, H] at ``positions`` [n]:
    k_l = RoPE(c W_k,l), v_l = c W_v,l, each [l, n, h, d]."""
    ks, vs = [], []
    for lp in dparams["layers"]:
        ks.append(rope(_heads(_dot(c, lp["wk"]), dcfg), positions, dcfg.head_dim, ROPE_THETA))
        vs.append(_heads(_dot(c, lp["wv"]), dcfg))
    return jnp.stack(ks), jnp.stack(vs)


def context_kv(dparams, dcfg: DrafterConfig, hidden, positions):
    """Each draft layer's keys and values of committed positions' target features.

    Notation: n positions, n_L target layers, H hidden, l draft layers, h heads, d head dim.
    hidden [n, n_L, H] target hidden states; positions [n] int32.
    Math: c = RMSNorm(concat_L(hidden) W_fc); k_l = RoPE(c W_k,l), v_l = c W_v,l.
    Returns (k, v), each [l, n, h, d].
    """
    return feature_kv(dparams, dcfg, context_features(dparams, hidden), positions)


def ring_rows(dparams, dcfg: DrafterConfig, hidden, positions) -> tuple:
    """What a slot's ring keeps of positions [n] with target hidden states [n, n_L, H]
    (``DrafterConfig.ring``), slot axis first: "kv" (k, v) each [n, l, h, d]; "features"
    (c,) [n, H]."""
    c = context_features(dparams, hidden)
    if dcfg.ring == "features":
        return (c,)
    return tuple(jnp.moveaxis(a, 0, 1) for a in feature_kv(dparams, dcfg, c, positions))


def ring_shapes(dcfg: DrafterConfig, hidden: int) -> tuple:
    """The shapes of one slot's ring leaves (``ring_rows`` of W positions)."""
    if dcfg.ring == "features":
        return ((dcfg.window, hidden),)
    return ((dcfg.window, dcfg.num_layers, dcfg.num_heads, dcfg.head_dim),) * 2


def draft_logits(dparams, dcfg: DrafterConfig, target, anchor, start, ctx_k, ctx_v, ctx_ok):
    """Logits of one draft block.

    Notation: T = gamma + 1 block positions start .. start+gamma; R context rows; V vocab.
    target: (embedding [V, H], head [H, V]) of the target; anchor [] int32 the last accepted
    token (at ``start``); ctx_k, ctx_v [l, R, h, d] keys/values of committed positions' target
    features; ctx_ok [R] bool the rows this block may read (its window; others may hold NaN).
    Math: x = [E(anchor), m, .., m]; per layer: x += Attn(RMSNorm(x)) over the block
      (non-causal) and the readable context rows, x += MLP(RMSNorm(x)); logits = RMSNorm(x) E_head.
    Returns [T, V] f32; row i (i >= 1) proposes the token at position start + i.
    """
    embed, head = target
    t_len = dcfg.gamma + 1
    positions = start + jnp.arange(t_len)
    x = jnp.concatenate([embed[anchor][None], jnp.broadcast_to(dparams["mask"],
                                                                (dcfg.gamma, embed.shape[1]))])
    scale = dcfg.head_dim ** -0.5
    for i, lp in enumerate(dparams["layers"]):
        hn = _rms(x, lp["attn_norm"])
        q = rope(_heads(_dot(hn, lp["wq"]), dcfg), positions, dcfg.head_dim, ROPE_THETA)
        kb = rope(_heads(_dot(hn, lp["wk"]), dcfg), positions, dcfg.head_dim, ROPE_THETA)
        vb = _heads(_dot(hn, lp["wv"]), dcfg)
        ck = jnp.where(ctx_ok[:, None, None], ctx_k[i], 0.0)  # unreadable rows may be NaN
        cv = jnp.where(ctx_ok[:, None, None], ctx_v[i], 0.0)
        lg_c = jnp.einsum("thd,rhd->htr", q, ck, precision=HIGHEST) * scale
        lg_c = jnp.where(ctx_ok[None, None, :], lg_c, -jnp.inf)
        lg_b = jnp.einsum("thd,shd->hts", q, kb, precision=HIGHEST) * scale
        probs = jax.nn.softmax(jnp.concatenate([lg_c, lg_b], axis=-1), axis=-1)
        r = ck.shape[0]
        out = (jnp.einsum("htr,rhd->thd", probs[..., :r], cv, precision=HIGHEST)
               + jnp.einsum("hts,shd->thd", probs[..., r:], vb, precision=HIGHEST))
        x = x + _dot(out.reshape(t_len, -1), lp["wo"])
        hn = _rms(x, lp["mlp_norm"])
        x = x + _dot(jax.nn.silu(_dot(hn, lp["gate"])) * _dot(hn, lp["up"]), lp["down"])
    return _dot(_rms(x, dparams["final_norm"]), head)


@struct.dataclass
class DrafterWindow:
    """One slot's ring of the W newest committed positions (``ring_rows``: draft keys and
    values, or target features); position q sits at slot q % W."""

    rows: tuple  # ring leaves, slot axis first, f32, NaN where empty (``ring_shapes``)
    positions: jnp.ndarray  # [W] int32 position held by each slot, -1 = empty

    @classmethod
    def empty(cls, dcfg: DrafterConfig, hidden: int) -> DrafterWindow:
        """An empty ring of a drafter for a target of hidden size ``hidden``."""
        return cls(tuple(jnp.full(s, jnp.nan, jnp.float32) for s in ring_shapes(dcfg, hidden)),
                   jnp.full((dcfg.window,), -1, jnp.int32))

    def write(self, rows, positions, ok) -> DrafterWindow:
        """Puts ``rows`` (``ring_rows`` of ``positions`` [n]) where ``ok`` at their ring slots
        (n <= W, distinct residues)."""
        w = self.positions.shape[0]
        at = jnp.where(ok, positions % w, w)  # out of bounds -> dropped
        return DrafterWindow(tuple(a.at[at].set(r, mode="drop") for a, r in zip(self.rows, rows)),
                             self.positions.at[at].set(positions, mode="drop"))

    def readable(self, start) -> jnp.ndarray:
        """[W] bool: slots a block at ``start`` reads (committed positions start-W .. start-1)."""
        p = self.positions
        return (p >= 0) & (p < start) & (p >= start - p.shape[0])


def draft_block(dparams, dcfg: DrafterConfig, target, window: DrafterWindow, anchor, start):
    """The drafter over its ring window (serving): logits [gamma + 1, V] of the block at
    ``start`` whose first token is ``anchor``. A "features" ring recomputes the window's keys
    and values here (W rows per draft layer; unreadable rows zeroed first: they may be NaN)."""
    ok = window.readable(start)
    if dcfg.ring == "features":
        (c,) = window.rows
        ck, cv = feature_kv(dparams, dcfg, jnp.where(ok[:, None], c, 0.0), window.positions)
    else:
        ck, cv = (jnp.moveaxis(a, 0, 1) for a in window.rows)
    return draft_logits(dparams, dcfg, target, anchor, start, ck, cv, ok)


__all__ = ["DrafterWindow", "context_features", "context_kv", "draft_block", "draft_logits",
           "feature_kv", "init_drafter", "ring_rows", "ring_shapes", "target_io"]
