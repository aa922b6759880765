"""Layer-streamed prefill (LeanSparse §4): per-layer prefix state on the host, two GPU buffers.

The monolithic ``steps.prefill`` runs one jitted Transformer per chunk over the caches of all
layers on the device. Here each chunk walks the layers one at a time: layer l's state (its
``LayerCache``: SWA window ring, compressor rings, compressed KV, FP8 indexer keys, DSA rows)
lives in ``pinned_host`` memory between uses and visits the device only while layer l runs.

Schedule of one chunk (H2D/D2H = host-to-device / device-to-host copies, all asynchronous):

    issue H2D(state 0)                      # before the embedding, as the paper's first load
    x = embed(tokens)
    for l in 0 .. L-1:
        issue H2D(state l+1)                # overlaps the compute of layer l (dispatch is async)
        x, state l = Block_l(x, state l)    # state l donated: the update is in place
        issue D2H(state l)                  # writeback; the device copy is then dropped
    logits = lm_head(final_norm(x))         # last chunk only

The first chunk has no prefix to load: its layer states start as the empty (NaN) caches, made
directly on the device, as the paper's "without a cached prefix, the first chunk starts with no
prefix state to load".

Device bytes. Notation: S_l the bytes of layer l's state (``layer_state_bytes``), A the
activations of a chunk (x [T, hidden] f32, the DSA leaders' selections [T, k] of the current
share group, a block's temporaries) and P the parameters.
  - monolithic ``steps.prefill``: P + 2 sum_l S_l + A (``forward_chunk`` does not donate the
    caches, so a chunk holds the input and the output caches of every layer);
  - streamed: P + max_l (S_l + S_{l+1}) + A (``stream_state_bytes``): the stream holds layer
    l's buffer (being computed, then written back) and layer l+1's (being loaded), never more.
    Layer l's buffer is donated to its Block, so the updated state aliases the loaded one; once
    its writeback is issued the stream drops it, and the device allocator can hand that memory
    to layer l+2's load, issued next (the two buffers alternate). The reuse goes through the
    allocator because JAX cannot ``device_put`` into an existing buffer, and a jitted copy into
    a donated buffer would run on the compute stream, serialized with the compute it should
    overlap.
  ``stream_prefix`` keeps the result on the host (a ``StreamedPrefix``) and can extend an
  existing prefix, also one held elsewhere (``PrefixLayer``: a detached request's host pages
  and saved state, ``serving.prefix``). With ``finish`` the last chunk hands each layer's
  finished state to the caller instead of writing it back: the engine admits it into its slot
  at once (``serving.state.admit_layer``: paged methods write its complete pages to host pages
  and PQ codes to the device), so an admission never holds more than the decode state and the
  two buffers (``memory.accounting.admission_device_bytes``). ``streamed_prefill`` (the
  ``steps.prefill`` contract, kept for comparisons) uploads every layer at the end instead:
  that materializes sum_l S_l once.
Each transfer moves a layer's whole state at its max_len capacity (the paper's buffers at
configured capacities), not a page plan of the rows the prefix has filled so far.

Compilation does not grow with L: one jitted Block per layer role (kind, and for DSA whether the
layer leads its share group), plus a jitted embedding and head. They are ``Transformer``'s own
modules (``Transformer.embedding``, ``Transformer.block``, ``Head``) on its parameters, so
the caches and logits equal ``steps.prefill``'s bit for bit (tested on CPU; on the GPU
``benchmarks/prefill_stream_gpu.py`` checks it, as XLA there may fuse the two differently).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from lsparse_jax.config import ModelConfig
from lsparse_jax.memory.accounting import layer_state_bytes, stream_state_bytes
from lsparse_jax.model.cache import LayerCache, empty_layer_cache
from lsparse_jax.model.store import Selection
from lsparse_jax.model.transformer import Head, Transformer

HOST, DEVICE = "pinned_host", "device"


@dataclasses.dataclass
class StreamedPrefix:
    """One request's prefix state after a streamed prefill: every layer in host memory.

    caches: per layer a ``LayerCache`` whose leaves are ``pinned_host`` arrays (or a
      ``PrefixLayer``: state held elsewhere, loaded on first use; None after ``finish``).
    length: prompt tokens the state holds. last_logits: [V] f32 logits of the last token.
    """

    caches: tuple[LayerCache, ...]
    length: int
    last_logits: jax.Array

    def to_device(self, device: jax.Device | None = None) -> tuple[LayerCache, ...]:
        """The caches copied to ``device`` memory (what ``steps.prefill`` returns)."""
        device = device or _devices(self.caches)
        return jax.device_put(self.caches, SingleDeviceSharding(device, memory_kind=DEVICE))


@runtime_checkable
class PrefixLayer(Protocol):
    """One layer of a prefix kept outside the stream's own host copies (e.g. a detached
    request's host pages and saved device state, ``serving.prefix``)."""

    def load(self, sharding) -> LayerCache:
        """The layer's resident-layout state (``empty_layer_cache``'s shapes) on ``sharding``'s
        device memory."""


@dataclasses.dataclass(frozen=True)
class LayerEvent:
    """What ``on_layer`` sees after layer ``layer`` of the chunk at ``start`` was issued.

    held: the layer states the stream holds on the device at that moment (its two buffers:
    this layer's updated state, whose writeback was just issued, and the next layer's load).
    """

    start: int
    layer: int
    held: dict[int, LayerCache]


def _devices(tree) -> jax.Device:
    leaf = jax.tree.leaves(tree)[0]
    return next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]


def _role(cfg: ModelConfig, layer: int) -> int:
    """The first layer with ``layer``'s kind and DSA role: its Block compiles for all of them.

    A Block uses its layer index only through the layer's kind; DSA followers differ from
    leaders by taking a shared Selection and having no indexer (and zero-row index keys).
    """
    def key(i):
        kind = cfg.layer_pattern[i]
        return kind, kind == "dsa" and cfg.dsa_leader(i) == i

    return next(i for i in range(cfg.num_layers) if key(i) == key(layer))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(embed_params, cfg: ModelConfig, tokens):
    return Transformer(cfg).embedding().apply({"params": embed_params}, tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "implementation"),
                   donate_argnames=("cache",))
def _block(block_params, cfg: ModelConfig, layer: int, x, cache, start, num_valid,
           shared: Selection | None, implementation: str | None):
    # the Block steps.forward_chunk's Transformer builds
    block = Transformer(cfg, implementation=implementation).block(layer)
    return block.apply({"params": block_params}, x, cache, start, num_valid, shared)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, cfg: ModelConfig, x):
    return Head(cfg).apply({"params": params}, x)


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _empty(cfg: ModelConfig, layer: int) -> LayerCache:
    return empty_layer_cache(cfg, layer)


def _check(cfg: ModelConfig, n: int, chunk: int, start: int):
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"streamed_prefill: chunk={chunk!r} must be a positive int")
    if n == 0:
        raise ValueError("streamed_prefill: the prompt is empty")
    if start + n > cfg.max_len:
        raise ValueError(f"streamed_prefill: prompt of {start + n} tokens exceeds "
                         f"ModelConfig.max_len={cfg.max_len}")


def stream_prefix(params, cfg: ModelConfig, tokens, chunk: int, *,
                  prefix: StreamedPrefix | None = None, progress=None, overlap: bool = True,
                  on_layer: Callable[[LayerEvent], None] | None = None,
                  store: str = HOST,
                  finish: Callable[[int, LayerCache], None] | None = None,
                  implementation: str | None = "xla") -> StreamedPrefix:
    """Layer-streamed chunked prefill; the state stays on the host.

    tokens [n] int32 are appended to ``prefix`` (None: an empty context). Chunks of ``chunk``
    tokens (the last padded) as in ``steps.prefill``; ``progress.update(valid tokens)`` after
    each chunk. ``overlap=False`` waits for every transfer before going on (the no-overlap
    baseline of the benchmark). ``on_layer(LayerEvent)`` is called after each layer is issued.
    ``store``: the memory kind the state waits in between layers: "pinned_host" (streaming) or
    "device" (the same per-layer schedule without transfers: the benchmark's compute baseline;
    it consumes ``prefix``'s arrays, which its blocks donate).
    ``prefix.caches`` may hold ``PrefixLayer``s (a detached request's host pages and saved
    state, ``serving.prefix``): each is loaded by its ``load`` in the first chunk.
    ``finish(layer, device cache)``: called with each layer's state when the last chunk has
    updated it, instead of its writeback (the engine admits the layer into a slot from it);
    the returned prefix then holds None for every layer.
    """
    if store not in (HOST, DEVICE):
        raise ValueError(f"stream_prefix: store={store!r} must be {HOST!r} or {DEVICE!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    start0 = 0 if prefix is None else prefix.length
    _check(cfg, n, chunk, start0)
    dev = _devices(params)
    on_dev = SingleDeviceSharding(dev, memory_kind=DEVICE)
    on_host = SingleDeviceSharding(dev, memory_kind=store)
    num = cfg.num_layers
    host = [None] * num if prefix is None else list(prefix.caches)
    roles = [_role(cfg, i) for i in range(num)]
    leaders = [cfg.dsa_leader(i) if k == "dsa" else i for i, k in enumerate(cfg.layer_pattern)]

    def wait(tree):
        if not overlap:
            jax.block_until_ready(tree)
        return tree

    def load(layer):
        if host[layer] is None:  # no prefix yet: the empty state is made on the device
            return jax.device_put(_empty(cfg, roles[layer]), on_dev)  # committed, as loads are
        if isinstance(host[layer], PrefixLayer):  # a detached prefix: its pages + saved state
            return wait(host[layer].load(on_dev))
        return wait(jax.device_put(host[layer], on_dev))

    padded = jnp.pad(tokens, (0, -n % chunk))
    logits = None
    for offset in range(0, n, chunk):
        start, valid = start0 + offset, min(chunk, n - offset)
        nxt = load(0)
        x = jax.device_put(_embed(params["embed"], cfg, padded[offset:offset + chunk]), on_dev)
        selections: dict[int, Selection] = {}
        for layer in range(num):
            cur, nxt = nxt, (load(layer + 1) if layer + 1 < num else None)
            shared = None if leaders[layer] == layer else selections[leaders[layer]]
            x, cur, sel = _block(params[f"block_{layer}"], cfg, roles[layer], x, cur, start,
                                 valid, shared, implementation)
            if leaders[layer] == layer and cfg.layer_pattern[layer] == "dsa":
                selections = {layer: sel}  # a group's selection lives until its next leader
            if finish is not None and offset + chunk >= n:  # the layer is done: admit it
                finish(layer, cur)
                host[layer] = None
            else:
                host[layer] = wait(jax.device_put(wait(cur), on_host))
            if on_layer is not None:
                held = {layer: cur} if nxt is None else {layer: cur, layer + 1: nxt}
                on_layer(LayerEvent(start, layer, held))
            del cur, sel  # drop the device copy: its memory serves the load of layer + 2
        if offset + chunk >= n:
            logits = _head({k: params[k] for k in ("final_norm", "lm_head")}, cfg, x)[valid - 1]
        if progress is not None:
            progress.update(valid)
    return StreamedPrefix(tuple(host), start0 + n, logits)


def streamed_prefill(params, cfg: ModelConfig, tokens, chunk: int, *, progress=None,
                     overlap: bool = True, implementation: str | None = "xla"):
    """``steps.prefill`` computed layer by layer through two device buffers.

    Same contract: returns (per-layer caches on the device, logits of the last prompt token
    [V]), equal to ``steps.prefill``'s bit for bit. See the module docstring for the schedule
    and the device bytes.
    """
    prefix = stream_prefix(params, cfg, tokens, chunk, progress=progress, overlap=overlap,
                           implementation=implementation)
    return prefix.to_device(_devices(params)), prefix.last_logits


__all__ = ["LayerEvent", "PrefixLayer", "StreamedPrefix", "layer_state_bytes", "stream_prefix",
           "stream_state_bytes", "streamed_prefill"]
