"""Packed pools: the leaves of a row stored side by side as one row of uint32 words.

A pytree pool (e.g. LeanSparse's FP8 indexer keys: 128 e4m3 values and one f32 scale a row, as
two arrays) costs a host read per leaf for every missed row; a ``PackedPool`` holds the same
bytes in one [N, W] uint32 array, so a missed row is one read of W words (H100, session 43,
``benchmarks/host_rows_gpu.py --layouts keys``: 12288 random key rows from a 2.2 GB pinned
pool in 157 us packed against 287 us as two arrays).

Notation: leaves l = 0..L-1 of a row, each [D_l] of dtype t_l with D_l * bytes(t_l) a multiple
of 4; w_l = D_l * bytes(t_l) / 4 words at offset o_l = w_0 + ... + w_{l-1}; W = sum_l w_l.
Row r of the pool is leaf l's row r in words [o_l, o_l + w_l) (little-endian bytes, as a
bitcast gives them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedPool:
    """A pool [N, W] uint32 of rows packed from leaves ``layout`` = ((dtype name, D_l), ...)
    in the leaf order of ``treedef`` (the structure of the rows it packs)."""

    words: jax.Array
    layout: tuple[tuple[str, int], ...]
    treedef: jax.tree_util.PyTreeDef

    def tree_flatten(self):
        return (self.words,), (self.layout, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def offsets(self) -> tuple[tuple[int, int], ...]:
        """(o_l, w_l) of every leaf."""
        return offsets(self.layout)


def leaf_words(dtype, d: int) -> int:
    """w_l of a leaf of D values of ``dtype``; raises ValueError when D * bytes is not a
    multiple of 4 (no whole words to pack)."""
    size = d * jnp.dtype(dtype).itemsize
    if size % 4:
        raise ValueError(f"packed pool: a leaf of {d} x {jnp.dtype(dtype).name} is {size} "
                         "bytes, not whole 4-byte words")
    return size // 4


def offsets(layout) -> tuple[tuple[int, int], ...]:
    """(o_l, w_l) of every leaf of ``layout``."""
    out, o = [], 0
    for name, d in layout:
        w = leaf_words(name, d)
        out.append((o, w))
        o += w
    return tuple(out)


def layout_of(rows) -> tuple[tuple[tuple[str, int], ...], jax.tree_util.PyTreeDef]:
    """(layout, treedef) of a pytree of row leaves [..., D_l]."""
    leaves, treedef = jax.tree.flatten(rows)
    layout = tuple((jnp.dtype(x.dtype).name, int(x.shape[-1])) for x in leaves)
    for name, d in layout:
        leaf_words(name, d)
    return layout, treedef


def as_words(x):
    """A leaf [..., D] as uint32 words [..., D * bytes / 4] (a bitcast; no values change)."""
    itemsize = jnp.dtype(x.dtype).itemsize
    if itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)  # [..., D] or [..., D, itemsize]
    b = b.reshape(*x.shape[:-1], x.shape[-1] * itemsize)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4),
                                        jnp.uint32)


def from_words(w, dtype, d: int):
    """Inverse of ``as_words``: words [..., w_l] -> [..., D] of ``dtype``."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(w, dtype)
    b = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], d * dtype.itemsize)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*w.shape[:-1], d, dtype.itemsize), dtype)


def pack(rows):
    """Rows (a pytree of leaves [..., D_l]) as words [..., W] uint32, leaves side by side."""
    return jnp.concatenate([as_words(x) for x in jax.tree.leaves(rows)], axis=-1)


def unpack(words, layout, treedef):
    """Inverse of ``pack``: words [..., W] -> the pytree of leaves ``layout`` describes."""
    return jax.tree.unflatten(treedef, [from_words(words[..., o:o + w], name, d) for (name, d),
                                        (o, w) in zip(layout, offsets(layout))])


def unpack_numpy(words: np.ndarray, layout, treedef):
    """``unpack`` of a host numpy copy, in numpy (for checks that read pools back)."""
    return jax.tree.unflatten(treedef, [
        np.ascontiguousarray(words[..., o:o + w]).view(jnp.dtype(name))
        .reshape(*words.shape[:-1], d) for (name, d), (o, w) in zip(layout, offsets(layout))])


__all__ = ["PackedPool", "as_words", "from_words", "layout_of", "leaf_words", "offsets", "pack",
           "unpack", "unpack_numpy"]
