"""The control plane: admits prompts into slots, runs decode steps, collects metrics.

Host-side Python with small numpy bookkeeping; all caches live in the jitted ``DecodeState``.
Multi-turn reuse: ``detach`` keeps a finished request's context host-resident as a
``serving.prefix.Prefix``; ``admit(prefix=)`` prefills only what a new prompt adds to it.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from lsparse_jax.config import EngineConfig
from lsparse_jax.memory.accounting import prefill_transient_bytes, request_bytes
from lsparse_jax.methods import policy
from lsparse_jax.model.transformer import serving_params
from lsparse_jax.parallel import engine_mesh, replicate, shard_params
from lsparse_jax.quant import KVRowFormat
from lsparse_jax.serving import stats
from lsparse_jax.serving.mixed import mixed_step
from lsparse_jax.serving.prefill_stream import StreamedPrefix, stream_prefix
from lsparse_jax.serving.prefix import Prefix, check_reuse, export_layer, loaders, tree_bytes
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import (
    DecodeState,
    admit,
    admit_done,
    admit_layer,
    empty_state,
    slot_bytes,
)
from lsparse_jax.serving.steps import (
    DecodeOutput,
    PrefillChunks,
    choose_feed,
    launch_step,
    prefill,
    prefill_chunks,
    sparse_layers,
    step_tail,
)


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A decode step ``Engine.launch`` dispatched (``Engine.collect`` reads it back)."""

    out: DecodeOutput
    feed: jax.Array  # [S] int32 on the device: each slot's next input (its sampled token)
    requests: dict  # slot -> the Request it ran for (the slots it ran)
    forced: np.ndarray | None  # [S] teacher-forced inputs, if any


class Engine:
    """Serves up to ``config.cache.num_slots`` requests with one jitted decode step.

    The serving method is a policy value (``lsparse_jax.methods``): its data plane runs inside
    the jitted steps, its controller (host pages, lent pages) is asked what an admission needs
    and what a release or a step must run. The engine itself never asks which method it runs.
    """

    pipelines = True  # launch / decode: steps launched ahead of reading their tokens

    def __init__(self, config: EngineConfig, params, codebooks: dict | None = None):
        """codebooks: {CSA layer: [M, K, D_I/M]} PQ codebooks, needed by leansparse.
        With ``config.tp`` > 1 the parameters are split over the mesh (``lsparse_jax.parallel``).
        The matmul weights are stored as ``ModelConfig.weight_dtype`` says
        (``model.transformer.serving_params``)."""
        params = serving_params(params, config.model)
        self.mesh = engine_mesh(config)
        if self.mesh is not None:
            params = shard_params(params, self.mesh)
        self.config, self.params = config, params
        self.method = policy(config)
        self.control = self.method.controller()
        self.state: DecodeState = empty_state(config, codebooks)
        slots = config.cache.num_slots
        self.active = np.zeros(slots, bool)
        self.limit = np.zeros(slots, np.int64)  # tokens each slot may hold (its reservation)
        self.next_token = np.zeros(slots, np.int32)
        self._zero_feed: jax.Array | None = None  # see _no_feed
        self.generated: list[list[int]] = [[] for _ in range(slots)]
        self.requests: dict[int, Request] = {}  # slot -> the request it serves
        self.lengths = np.zeros(slots, np.int64)  # host mirror of state.lengths (no reads)
        self.stats = stats.SelectionStats.empty(slots, len(sparse_layers(config.model)),
                                                config.model.indexer.top_k)
        if self.mesh is not None:  # beside the replicated outputs of the decode step
            self.stats = replicate(self.stats, self.mesh)
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_tokens = 0
        self._rng = jax.random.key(config.sampling.seed + 1)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot's caches."""
        return slot_bytes(self.config, self.state)

    def request_device_bytes(self, context: int) -> int:
        """Device bytes one request of ``context`` tokens holds on this engine
        (``memory.accounting.request_bytes``); a scheduler's budget admits by it."""
        return request_bytes(self.config, context).gpu_total

    def prefill_device_bytes(self, prompt_tokens: int) -> int:
        """Device bytes an admission's prefill of ``prompt_tokens`` holds beside the
        request's decode bytes until it enters decode
        (``memory.accounting.prefill_transient_bytes``: two layer buffers when streamed,
        every layer's state otherwise)."""
        return prefill_transient_bytes(self.config, prompt_tokens)

    def warmup(self, writeback: bool = True):
        """Compiles the prefill chunk and the decode step so that timings exclude compilation,
        and the method's step updates (``Controller.warmup``; writeback=False leaves the
        completed-page writeback of paged methods to compile at its first use: a workload
        whose requests never complete a page, e.g. the accuracy study's, never runs it)."""
        cfg, chunk = self.config.model, self.config.cache.prefill_chunk
        tokens = np.zeros(min(chunk + 1, cfg.max_len), np.int32)  # a full and a partial chunk
        jax.block_until_ready(prefill(self.params, cfg, tokens, chunk,
                                      implementation=self.config.implementation))
        # An all-idle step writes nothing and selects nothing (only the sampling key moves;
        # the statistics add nothing); then the statistics' and the controller's updates.
        idle, tokens = np.zeros(self.active.shape, bool), self.next_token.copy()
        self.state, self.stats, _, _ = launch_step(
            self.params, self.config, self.state, self.stats, tokens, self._no_feed(), idle,
            tokens, idle, idle)
        self.stats = stats.admitted(self.stats, 0)
        self.state = self.control.warmup(self.state, writeback)
        jax.block_until_ready(self.state)

    def admit(self, request: Request | np.ndarray, max_new_tokens: int | None = None,
              progress=None, prefilled=None, *, prefix: Prefix | None = None,
              on_layer=None) -> int:
        """Prefills ``request`` into a free slot and samples its first token; returns the slot.

        ``request``: a ``Request`` (or a prompt, with ``max_new_tokens``, made into one).
        The method's controller reserves what prompt + max_new_tokens need (paged methods:
        host pages) first, so running out of host memory fails here (``CapacityError``),
        before anything changes.
        With ``CacheConfig.streamed_prefill`` (and always with ``prefix``) the prefill streams
        layer by layer (``prefill_stream``) and each layer is admitted into the slot as it
        finishes (``state.admit_layer``): the device never holds more than the decode state
        and two layer buffers. Otherwise ``steps.prefill`` computes every layer's caches on the
        device and ``state.admit`` admits them.
        prefilled: (caches, last logits) that ``steps.prefill`` (or the last chunk of
        ``prefill_chunks``) returned for this prompt and model, to share one prefill between
        engines (every method prefills alike); or the ``StreamedPrefix`` that a streamed
        engine's ``prefill_chunks`` ends with (its layers admitted one at a time).
        prefix: a ``Prefix`` from ``detach``; ``request.prompt`` must extend its tokens. Only
        the suffix is prefilled, the prefix state streamed in from the host; the prefix is
        consumed (its host pages become the request's) unless this raises.
        on_layer: observer of the stream (``prefill_stream.LayerEvent``), for measurements.
        """
        if not isinstance(request, Request):
            request = Request(request, max_new_tokens)
        elif max_new_tokens is not None:
            raise ValueError("admit: max_new_tokens belongs to the Request")
        cfg, prompt = self.config.model, request.prompt
        new = request.max_new_tokens
        total = cfg.max_len if new is None else len(prompt) + new
        if total > cfg.max_len:
            raise ValueError(f"admit: prompt {len(prompt)} + max_new_tokens {new} "
                             f"exceeds ModelConfig.max_len={cfg.max_len}")
        if isinstance(prefilled, StreamedPrefix):
            if prefilled.length != len(prompt):
                raise ValueError(f"admit: the streamed prefill holds {prefilled.length} "
                                 f"tokens; the prompt has {len(prompt)}")
            if any(c is None for c in prefilled.caches):
                raise ValueError("admit: the streamed prefill's layers were admitted already")
        held = ()
        if prefix is not None:
            check_reuse(self.config)
            self._check_prefix(prefix, prompt, prefilled)
            held = prefix.pages
        free = np.flatnonzero(~self.active)
        if free.size == 0:
            raise RuntimeError(f"admit: all {self.active.size} slots are busy")
        slot = int(free[0])
        grant, before = self.control.reserve(slot, total, len(prompt), held=held)
        t0 = time.perf_counter()
        request.admitted_at = t0
        for update in before:
            self.state = update(self.state)
        if prefilled is None and (prefix is not None or self.config.cache.streamed_prefill):
            last = self._stream_admit(slot, prompt, prefix, grant, progress, on_layer)
        elif isinstance(prefilled, StreamedPrefix):  # the last of prefill_chunks, streamed
            last = self._admit_streamed(slot, prefilled, grant)
        else:
            if prefilled is None:
                prefilled = prefill(self.params, cfg, prompt, self.config.cache.prefill_chunk,
                                    progress=progress, implementation=self.config.implementation)
            caches, last = prefilled
            self.state = admit(self.config, self.state, slot, caches, len(prompt), grant)
        self._rng, key = jax.random.split(self._rng)
        first = int(sample(last[None], key, self.config.sampling.temperature)[0])
        jax.block_until_ready(self.state)
        now = time.perf_counter()
        self.prefill_seconds += now - t0
        self.active[slot], self.next_token[slot], self.limit[slot] = True, first, total
        self.generated[slot] = request.tokens
        request.tokens[:] = [first]
        request.first_token_at = now
        request.token_times[:] = [now]
        self.requests[slot] = request
        self.lengths[slot] = len(prompt)
        self.stats = stats.admitted(self.stats, slot)
        return slot

    def prefill_chunks(self, prompt: np.ndarray):
        """Chunked prefill of ``prompt``, one ``prefill_chunk`` per ``next`` (a scheduler
        interleaves them with decode steps): yields (prefilled, valid tokens of the chunk); the
        last ``prefilled`` is what ``admit(prefilled=...)`` takes, the same as ``admit``'s own
        prefill computes: a ``steps.PrefillChunks``, whose next chunk ``step(prefill=)`` can
        run fused with a decode step. With ``CacheConfig.streamed_prefill`` each chunk streams
        through the layers (``prefill_stream.stream_prefix``, two device buffers) and the state
        waits on the host between chunks: ``prefilled`` is the ``StreamedPrefix`` so far."""
        cfg = self.config
        if cfg.cache.streamed_prefill:
            return self._streamed_chunks(prompt)
        return prefill_chunks(self.params, cfg.model, prompt, cfg.cache.prefill_chunk,
                              cfg.implementation)

    def _streamed_chunks(self, prompt: np.ndarray):
        cfg, done = self.config, None
        chunk = cfg.cache.prefill_chunk
        for offset in range(0, len(prompt), chunk):
            part = prompt[offset:offset + chunk]
            done = stream_prefix(self.params, cfg.model, part, chunk, prefix=done,
                                 implementation=cfg.implementation)
            yield done, len(part)

    def _check_prefix(self, prefix: Prefix, prompt: np.ndarray, prefilled) -> None:
        prefix.check_held(self.control, "admit")
        if prefilled is not None:
            raise ValueError("admit: give a prefix or prefilled caches, not both")
        n = prefix.length
        if len(prompt) <= n or not np.array_equal(prompt[:n], prefix.tokens):
            why = ("must be longer than" if np.array_equal(prompt[:n], prefix.tokens)
                   else "does not start with")
            raise ValueError(f"admit: the prompt ({len(prompt)} tokens) {why} the prefix's "
                             f"tokens ({n} tokens)")

    def _stream_admit(self, slot: int, prompt, prefix: Prefix | None, grant, progress,
                      on_layer):
        """Layer-streamed prefill of the prompt (past ``prefix``), each layer admitted into
        ``slot`` as it finishes; returns the last prompt token's logits."""
        length = len(prompt)

        def finish(layer, cache):
            self.state = admit_layer(self.config, self.state, slot, layer, cache, length, grant)

        start, done = None, 0
        if prefix is not None:
            layers = loaders(self.config, prefix, lambda: self.state.tier)
            start, done = StreamedPrefix(layers, prefix.length, None), prefix.length
        out = stream_prefix(self.params, self.config.model, prompt[done:],
                            self.config.cache.prefill_chunk, prefix=start, progress=progress,
                            on_layer=on_layer, finish=finish,
                            implementation=self.config.implementation)
        self.state = admit_done(self.config, self.state, slot, length, grant)
        if prefix is not None:  # its pages are the request's now
            prefix.state, prefix.layers = "consumed", ()
        return out.last_logits

    def _admit_streamed(self, slot: int, streamed: StreamedPrefix, grant):
        """Admits a host-resident ``StreamedPrefix`` into ``slot`` one layer at a time (each
        layer's state loaded to the device, admitted, dropped: two layers' states at most);
        returns its last token's logits."""
        for layer, cache in enumerate(streamed.caches):
            leaf = jax.tree.leaves(cache)[0]
            on_dev = SingleDeviceSharding(next(iter(leaf.devices())), memory_kind="device")
            self.state = admit_layer(self.config, self.state, slot, layer,
                                     jax.device_put(cache, on_dev), streamed.length, grant)
        self.state = admit_done(self.config, self.state, slot, streamed.length, grant)
        return streamed.last_logits

    def detach(self, slot: int) -> Prefix:
        """Ends the request in ``slot`` as ``release`` does, but keeps its context (prompt +
        the generated tokens whose KV was written) host-resident as a ``Prefix``: its complete
        host pages stay reserved, the rest of its state is saved to pinned_host memory
        (``serving.prefix``). Admit a request extending it with ``admit(prefix=...)``, or free
        it with ``drop``."""
        check_reuse(self.config)
        if not self.active[slot]:
            raise ValueError(f"detach: slot {slot} is not active")
        request, length = self.requests[slot], int(self.lengths[slot])
        written = np.concatenate([request.prompt, np.asarray(request.tokens[:-1], np.int32)])
        cfg = self.config.model
        saved = tuple(export_layer(self.config, self.state, slot, i)
                      for i in range(cfg.num_layers))
        # to pinned_host by sharding, not by jax.memory.Space.Host: on jax 0.12.1's CPU client
        # an array put there by Space.Host cannot be put back with a device sharding
        # ("Unsupported layout used for PjRt CPU buffers"), which PrefixLoad.load does
        saved = jax.device_put(saved, jax.tree.map(
            lambda a: a.sharding.with_memory_kind("pinned_host"), saved))
        full = (length // cfg.csa_ratio) // self.config.cache.page_size
        pages = self.control.keep_pages(slot, full)
        host_bytes = tree_bytes(saved) + len(pages) * self._host_page_bytes()
        self.release(slot)
        return Prefix(written[:length], host_bytes, tuple(pages), saved, owner=self.control)

    def drop(self, prefix: Prefix) -> None:
        """Frees a prefix's host memory (its pages and saved state) without admitting it."""
        prefix.check_held(self.control, "drop")
        self.control.free_pages(prefix.pages)
        prefix.state, prefix.layers = "dropped", ()

    def _host_page_bytes(self) -> int:
        """Bytes of one host page id: its rows in every host pool (KV rows, and FP8 keys for
        leansparse) of every paged layer (P rows of a CSA layer, P * m of a DSA layer)."""
        tier = self.state.tier
        pools = [getattr(tier, name, None) for name in ("kv_pools", "key_pools")]
        return sum(leaf.nbytes for leaf in jax.tree.leaves(pools)) // self.config.host_pages

    def release(self, slot: int) -> list[int]:
        """Ends a request: frees its slot and what the method reserved; returns its tokens."""
        if not self.active[slot]:
            raise ValueError(f"release: slot {slot} is not active")
        self.active[slot] = False
        for update in self.control.release(slot):
            self.state = update(self.state)
        request = self.requests.pop(slot)
        request.finished_at = time.perf_counter()
        return request.tokens

    def step(self, tokens=None, prefill: PrefillChunks | None = None) -> DecodeOutput:
        """One decode step of every active slot. ``tokens`` [S] forces each active slot's
        next input (teacher forcing, e.g. to compare methods on identical contexts); by
        default each slot feeds the token it sampled last. Reads the step's tokens back before
        it returns (``decode`` runs several steps without waiting for each).
        prefill: a chunked prefill (``prefill_chunks``) whose next chunk runs in the same
        jitted program (``serving.mixed``); its ``last`` holds that chunk's yield after."""
        if tokens is not None:
            tokens = self._forced(tokens)
            self.next_token = np.where(self.active, tokens, self.next_token)
        self._check_room(1)
        t0 = time.perf_counter()
        out, _ = self._launch(self.active, prefill=prefill)
        sampled = np.asarray(out.tokens)
        now = time.perf_counter()
        self.decode_seconds += now - t0
        self._collect(sampled, tokens, now, self.active)
        return out

    def decode(self, n: int, inputs=None) -> np.ndarray:
        """``n`` decode steps of every active slot: the same tokens, state and statistics as
        ``n`` calls of ``step`` (tested), pipelined (``launch`` / ``collect``): step t + 1 is
        launched from step t's tokens on the device before step t's tokens are read back, so
        the host's per-step work (the read, token lists and timestamps, the controller's
        updates, the next launch) overlaps the device's next step instead of leaving it idle.

        inputs: [n, S] teacher-forced inputs, row t as ``step(inputs[t])`` takes it.
        The active set is fixed for the n steps: every active slot needs room for n more
        tokens. Returns the sampled tokens [n, S] (an inactive slot's column: its last token).
        Token timestamps are taken as each step's tokens reach the host, as in ``step``.
        """
        if n < 1:
            raise ValueError(f"decode: n must be >= 1, got {n}")
        slots = self.active.size
        if inputs is not None:
            inputs = np.asarray(inputs, np.int32)
            if inputs.shape != (n, slots):
                raise ValueError(f"decode: inputs must be [n={n}, slots={slots}], "
                                 f"got {inputs.shape}")
        self._check_room(n)
        t0 = time.perf_counter()
        sampled = np.empty((n, slots), np.int32)
        pending = None  # launched, not yet read back
        for t in range(n + 1):
            launched = None
            if t < n:
                launched = self.launch(pending, None if inputs is None else inputs[t])
            if pending is not None:
                self.collect(pending)  # waits for that step only; the next one runs
                sampled[t - 1] = self.next_token
            pending = launched
        self.decode_seconds += time.perf_counter() - t0
        return sampled

    def launch(self, prev: InFlight | None = None, forced: np.ndarray | None = None,
               skip: np.ndarray | None = None,
               prefill: PrefillChunks | None = None) -> InFlight:
        """Dispatches one decode step of the active slots that have room for a token, and
        returns at once (nothing on the device is waited for); ``collect`` reads it back.

        A slot that ran in ``prev`` (a launched step, collected or not) and still serves the
        same request feeds prev's sampled token straight from the device; a slot admitted
        since feeds the token its admission sampled. forced: [S] inputs overriding both
        (teacher forcing, as ``step(tokens)``).
        Slots without room (their reserved length reached) and those in ``skip`` [S] sit
        the step out: a scheduler that launches ahead of reading tokens
        (``Scheduler(overlap=True)``) skips those whose last token is in flight and finishes
        them when it reads it. prefill: as ``step``'s.
        """
        if not self.pipelines:
            raise ValueError(f"{type(self).__name__} does not launch steps ahead of reading "
                             "their tokens (Engine.launch / decode); call step()")
        live = self.active & (self.lengths < self.limit)
        if skip is not None:
            live &= ~skip
        if forced is not None:
            forced = self._forced(forced)
        requests = {s: self.requests[s] for s in np.flatnonzero(live)}
        out, feed = self._launch(live, prev, forced, prefill)
        return InFlight(out, feed, requests, forced)

    def collect(self, step: InFlight) -> np.ndarray:
        """Reads a launched step's tokens back (waiting for that step only) and hands each
        to its request, unless the slot has been released or re-admitted since (the token of
        a request that ended meanwhile is dropped). Returns the step's tokens [S]."""
        sampled = np.asarray(step.out.tokens)
        now = time.perf_counter()
        self._collect(sampled, step.forced, now, self._serving(step.requests))
        return sampled

    def _serving(self, requests: dict) -> np.ndarray:
        """[S] bool: slot s still serves ``requests[s]`` (a launched step's requests)."""
        mask = np.zeros(self.active.shape, bool)
        for s, r in requests.items():
            mask[s] = self.requests.get(s) is r
        return mask

    def _forced(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32)
        if tokens.shape != self.active.shape:
            raise ValueError(f"step: tokens must be [{self.active.size}], got {tokens.shape}")
        return tokens

    def _check_room(self, n: int) -> None:
        full = self.active & (self.lengths + n > self.limit)
        if full.any():
            raise RuntimeError(f"step: slots {np.flatnonzero(full).tolist()} reached their "
                               f"reserved length (max_new_tokens or max_len): room for fewer "
                               f"than {n} more tokens; release them")

    def _no_feed(self) -> jax.Array:
        """[S] int32 zeros on the device: ``launch_step``'s prev_feed when no step is in
        flight (a device array, as a launched step's feed is, so that both calls share one
        compilation)."""
        if self._zero_feed is None:
            self._zero_feed = jax.device_put(np.zeros(self.active.shape, np.int32),
                                             self.state.lengths.sharding)
        return self._zero_feed

    def _launch(self, live: np.ndarray, prev: InFlight | None = None,
                forced: np.ndarray | None = None,
                prefill: PrefillChunks | None = None) -> tuple[DecodeOutput, jax.Array]:
        """Dispatches one decode step of the ``live`` slots [S] and the updates around it,
        fused with ``prefill``'s next chunk if given; waits for nothing on the device. Each
        live slot feeds ``forced`` if given, else prev's sampled token where it still serves
        prev's request, else ``next_token``. Returns (the step's output, the next step's feed
        [S] on the device). The host mirrors (lengths) advance here."""
        for update in self.control.before_step():  # e.g. adaptive's refill of lent pages
            self.state = update(self.state)
        # host arrays are copied: the host mutates next_token and active in place later
        nothing, tokens, live = np.zeros(live.shape, bool), self.next_token.copy(), live.copy()
        inputs = (tokens, self._no_feed() if prev is None else prev.feed,
                  nothing if prev is None else self._serving(prev.requests),
                  tokens if forced is None else forced.copy(), nothing if forced is None else live,
                  live)
        if prefill is None:
            self.state, self.stats, out, feed = launch_step(self.params, self.config,
                                                            self.state, self.stats, *inputs)
        else:  # inputs committed to the state's device: one compilation (jit keys on it)
            chunk_tokens, start, valid = prefill.pending()
            feed, active, caches, chunk_tokens = jax.device_put(
                (choose_feed(*map(jnp.asarray, inputs[:5])), live, prefill.caches,
                 chunk_tokens), self.state.lengths.sharding)
            self.state, out, chunk = mixed_step(self.params, self.config, self.state, feed,
                                                active, caches, chunk_tokens, start, valid)
            prefill.advance(*chunk)
            self.stats, out, feed = step_tail(self.stats, out, feed, active)
        for update in self.control.after_step(self.lengths, live):  # page writeback
            self.state = update(self.state)
        self.lengths += live
        return out, feed

    def _collect(self, sampled: np.ndarray, forced, now: float, mine: np.ndarray) -> None:
        """The host bookkeeping of one finished step: its tokens [S] into the requests of
        the slots in ``mine``."""
        live = np.flatnonzero(mine)
        self.decode_tokens += live.size
        self.next_token = np.where(mine, sampled, self.next_token)
        for s in live:
            tokens = self.generated[s]
            if forced is not None:
                tokens[-1] = int(forced[s])  # the input the step was given
            tokens.append(int(sampled[s]))
            self.requests[s].token_times.append(now)

    def metrics(self) -> dict:
        row_bytes = KVRowFormat.of(self.config.model).row_bytes  # a CSA row as stored
        key_bytes = self.config.model.indexer.key_bytes
        selection = stats.as_dict(self.stats.totals(), row_bytes, key_bytes)
        return {
            "method": self.config.method,
            "prefill_seconds": self.prefill_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "device_bytes_per_request": self.slot_bytes,
            "selection": selection,
            "host_bytes_per_token": selection["host_bytes"] / max(self.decode_tokens, 1),
            **self.control.metrics(self.state),
        }
