"""Iteration-level scheduler over the engine (continuous batching, Orca-style).

Each iteration: (1) admit waiting requests in arrival order while a slot is free, the device
byte budget holds them and the method's controller can reserve their host pages; the first
one that does not fit waits (first come, first served: nobody overtakes it), and its wait is
counted; (2) one decode step of the active set; (3) every request that hit max_new_tokens
(or max_len), a stop token or a stop string is released at once, freeing its slot, bytes and
host pages.

Device bytes of a request are ``Engine.request_device_bytes`` at prompt + max_new_tokens
(``memory.accounting.request_bytes``; a SpecEngine adds its ring and staging).
With ``prefill_memory`` an admission also needs its prefill's transient bytes free beside
them until it enters decode (``Engine.prefill_device_bytes``: two layer buffers for a
layer-streamed prefill, every layer's state for a monolithic one; LeanSparse section 3:
"prefill's temporary memory demand can further delay admission even when enough memory
remains for the same request's subsequent decode"): such a wait has reason "prefill_memory".
A ``memory_model`` (the same engine config at a greater depth) counts both at that depth while
the engine runs its slice: the papers' byte ratios on a model too deep to run here.
With device pools (``CacheConfig.device_pages``) the pools are the budget: the controller's
reservation of a request's pages says whether it fits now (``DeviceCapacityError``: it waits,
reason "device_pool"), so each method's footprint per token decides how many fit.

Prefill, two modes. Whole-prompt (``prefill_token_budget`` None): ``Engine.admit`` prefills
the prompt blocking, so every decoding request stalls meanwhile. Chunked (Sarathi-style
stall-free batching at iteration level): an admitted request first holds a slot and its bytes
while its prompt is prefilled ``prefill_token_budget`` tokens (whole chunks) per iteration
beside the decode step (``Engine.prefill_chunks``: a ``SpecEngine``'s also keep the target
features its drafter's ring needs), and enters the engine (``Engine.admit(prefilled=...)``,
which then reserves its host pages) when its prompt is done. The chunks run as separate calls
before the decode step (unless ``mixed``, below), the same chunking as the engine's own
prefill, so the tokens equal those of whole-prompt admission. A layer-streamed engine
(``CacheConfig.streamed_prefill``) streams each chunk through its layers, the state waiting on
the host between chunks, and is admitted layer by layer from it. Host pages are reserved only
then: a prefilled request the host pool cannot hold yet waits, holding its slot and bytes.
With prefix reuse a continuation (its session's prefix held) is admitted whole in its turn
(``Engine.admit(prefix=...)``: only its suffix is prefilled), the others chunked.

Mixed iterations (``mixed=True``, chunked mode; Sarathi-Serve's mixed batches): in an
iteration with requests decoding, one chunk of the budget (the next of the oldest prefill
that has chunks left after the separate ones) runs inside the decode step, one jitted
program (``serving.mixed``: each layer's norm + MLP and the LM head run once over the decode
tokens and the chunk's together, attention per path), and a prefill it completes enters the
engine right after the step. Tokens equal the unmixed schedule's (tested); the trace marks
mixed iterations, the summary counts them; a fixed clock charges the chunk's tokens as
unmixed. Not for a ``SpecEngine``, a layer-streamed prefill or tp > 1 (ValueError).

Workloads (``serving.workloads``): ``workload`` submits its ``initial()`` requests and, as
each request finishes, those ``on_finish(request, now)`` returns (closed-loop clients, the next
call of a multi-turn session after its tool wait). Prefix reuse (``prefix_reuse``, either
mode): a finished call whose session goes on is detached (``Engine.detach``: its context stays
host-resident as a ``Prefix``; also when the workload holds the next call back, its
``held_sessions``) instead of released, and the session's next call is admitted
with it (``Engine.admit(request, prefix=...)``: only the new suffix is prefilled, the prefix
streamed from host; in chunked mode too, whole); the fixed clock then charges prefill for the
suffix only. Held prefixes keep host pages: an admission the host pool cannot hold evicts the
oldest other session's prefix (``Engine.drop``; that session's next call prefills its whole
prompt) and retries at the next iteration.

Overlap (``overlap=True``, as SGLang's overlap scheduler): each iteration launches the next
decode step (``Engine.launch``) before reading the previous one back (``Engine.collect``), so
the host's scheduling work runs while the device decodes. A request that ends on a stop token
or stop string has then already been launched into one more step, whose token is dropped (the
slot's extra row is freed with it); one that reaches max_new_tokens sits that step out. Tokens
equal the non-overlapped schedule's (tested); selection statistics count the dropped steps.
Not with prefix reuse (a detached context would hold the dropped step's row).

Teacher-forced inputs (``inputs``, e.g. ``workloads.RepeatInputs``): each decode step feeds
``inputs(engine.next_token, fresh)`` instead of the sampled tokens (``fresh`` [S]: slots whose
request is new since the last step), as ``Engine.step(tokens=)`` / ``launch(forced=)`` take
them; a request's tokens then hold the inputs it was given (the KV its context holds, so a
detached prefix matches its text) and its last sampled token. What it is for: a tunable
step-to-step selection reuse at V4 shapes, where random weights select almost independently.

Time is the scheduler's ``Clock``, starting at 0: arrivals are read on it and every timestamp
of a ``Request`` is restamped on it. It advances by each admission's and step's measured wall
time, or by fixed costs (deterministic metrics), and jumps to the next arrival when idle.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from lsparse_jax.config import EngineConfig
from lsparse_jax.memory.accounting import prefill_transient_bytes, request_bytes
from lsparse_jax.memory.device_pool import DeviceCapacityError
from lsparse_jax.memory.host_pool import CapacityError
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.metrics import request_metrics, steady_state, summarize
from lsparse_jax.serving.mixed import check_mixed
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.steps import PrefillChunks

WAIT_REASONS = ("slots", "device_budget", "prefill_memory", "host_pool", "device_pool",
                "shared_pool", "shared_budget")


@dataclasses.dataclass
class Clock:
    """Scheduler time (seconds). ``step_s`` None: measured wall time; otherwise fixed costs,
    ``step_s`` per decode step and ``prefill_token_s`` per prompt token prefilled."""

    step_s: float | None = None
    prefill_token_s: float = 0.0
    now: float = 0.0

    def charge(self, wall: float, fixed: float) -> float:
        self.now += wall if self.step_s is None else fixed
        return self.now


@dataclasses.dataclass
class Prefill:
    """A request whose prompt is being prefilled in chunks."""

    request: Request
    chunks: Iterator  # Engine.prefill_chunks
    started: float  # when it was admitted (scheduler clock)
    done: int = 0  # prompt tokens prefilled
    result: Any = None  # what Engine.admit(prefilled=...) takes, once every chunk ran


class Scheduler:
    """Serves submitted ``Request``s on ``engine``.

    device_budget_bytes: the device bytes all admitted requests may hold together (None: only
    slots bound admission). prefill_token_budget: prompt tokens prefilled per iteration in
    chunked mode (rounded down to whole ``prefill_chunk``s, at least one); None prefills each
    prompt whole at admission. After ``run``: ``finished`` (requests in finishing order),
    ``admission_waits`` (iterations the head of the queue had arrived but did not fit) and
    ``waits_by`` (the same by reason), ``trace`` (per iteration: time, active, prefilling,
    waiting, device bytes in use), ``records()`` and ``summary()``. overlap: launch each
    decode step before reading the previous one (the module docstring). prefill_memory:
    charge each admission's prefill transient bytes to the budget too (module docstring).
    memory_model: the engine config whose bytes the budget counts, where it differs from the
    engine's in the model's layer pattern only (e.g. the 43-layer V4-Flash whose 4-layer slice
    runs: every per-layer footprint, a monolithic prefill's whole history included, counts
    at the full depth, while a layer-streamed prefill still holds two layer buffers); None
    counts the engine's own. mixed: run a chunk of each iteration inside its decode step
    (module docstring). inputs: teacher-forced decode inputs (module docstring); None feeds
    each request its sampled tokens.
    """

    def __init__(self, engine: Engine, device_budget_bytes: int | None = None,
                 clock: Clock | None = None, prefill_token_budget: int | None = None,
                 workload=None, prefix_reuse: bool = False, overlap: bool = False,
                 prefill_memory: bool = False, memory_model: EngineConfig | None = None,
                 mixed: bool = False, inputs=None):
        if mixed:
            _check_mixed(engine, prefill_token_budget)
        if memory_model is not None:
            _check_memory_model(engine, memory_model)
        if inputs is not None and type(engine).step is not Engine.step:
            raise ValueError(f"Scheduler: inputs force the decode step's inputs; "
                             f"{type(engine).__name__} runs its own step, which takes none")
        if prefill_memory and device_budget_bytes is None:
            raise ValueError("Scheduler: prefill_memory charges prefills to the device budget; "
                             "set device_budget_bytes")
        if prefix_reuse and workload is None:
            raise ValueError("Scheduler: prefix_reuse needs a workload whose sessions go on "
                             "(e.g. serving.workloads.MultiTurn)")
        if overlap and prefix_reuse:
            raise ValueError("Scheduler: overlap launches a step past a request's stop token, "
                             "whose row a detached prefix would keep; use one or the other")
        if overlap and not engine.pipelines:
            raise ValueError(f"Scheduler: overlap launches steps ahead of reading them; "
                             f"{type(engine).__name__} does not")
        self.overlap, self._in_flight = overlap, None
        self.engine, self.budget = engine, device_budget_bytes
        self.memory_model = memory_model
        self.clock = clock or Clock()
        self.prefill_token_budget = prefill_token_budget
        self.mixed, self._mixed = mixed, None  # the Prefill whose chunk rides on this step
        self.inputs, self._fed = inputs, {}  # forced inputs; slot -> request last fed
        self.mixed_iterations = 0
        self.waiting: list[Request] = []  # by arrival time
        self.prefilling: list[Prefill] = []  # chunked mode: admitted, prompt not yet done
        self.running: dict[int, Request] = {}  # slot -> request
        self.finished: list[Request] = []
        self.device_bytes_in_use = 0  # decode bytes of the admitted (and prefilling) requests
        self.prefill_memory, self._transient = prefill_memory, {}  # prompt tokens -> bytes
        self.prefill_bytes_in_use = 0  # chunked mode: the prefilling requests' transients
        self._peak = 0  # device bytes at the fullest moment of the current iteration
        self.admission_waits = 0
        self.waits_by = dict.fromkeys(WAIT_REASONS, 0)
        self.trace: list[dict] = []
        self._bytes: dict[int, int] = {}  # context tokens -> device bytes of one request
        self.workload, self.prefix_reuse = workload, prefix_reuse
        self.prefixes: dict = {}  # session -> the host-resident Prefix of its last call
        self.reused_tokens = 0  # prompt tokens admitted from a prefix (not prefilled)
        self.prefix_drops = 0  # prefixes evicted for host pages
        if workload is not None:
            self.submit(workload.initial())

    def device_bytes(self, request: Request) -> int:
        """Device bytes ``request`` holds: its slot sized to prompt + max_new_tokens."""
        cfg = self.memory_model or self.engine.config
        new = request.max_new_tokens
        context = cfg.model.max_len if new is None else len(request.prompt) + new
        if context not in self._bytes:
            self._bytes[context] = (self.engine.request_device_bytes(context)
                                    if self.memory_model is None
                                    else request_bytes(self.memory_model, context).gpu_total)
        return self._bytes[context]

    def prefill_bytes(self, request: Request) -> int:
        """Transient device bytes ``request``'s prefill holds until it enters decode (0
        unless ``prefill_memory``)."""
        if not self.prefill_memory:
            return 0
        n = len(request.prompt)
        if n not in self._transient:
            self._transient[n] = (self.engine.prefill_device_bytes(n)
                                  if self.memory_model is None
                                  else prefill_transient_bytes(self.memory_model, n))
        return self._transient[n]

    def submit(self, requests: Iterable[Request]) -> None:
        """Queues requests (served in arrival order; ties keep submission order)."""
        for r in requests:
            need = self.device_bytes(r) + self.prefill_bytes(r)
            if self.budget is not None and need > self.budget:
                raise ValueError(f"Scheduler: request {r.id!r} needs {need} device bytes "
                                 f"(decode {self.device_bytes(r)}, prefill transient "
                                 f"{self.prefill_bytes(r)}), more than the whole budget "
                                 f"{self.budget}")
            self.waiting.append(r)
        self.waiting.sort(key=lambda r: r.arrival_time)

    # ------------------------------------------------------------------------------ iteration
    def _blocked(self, r: Request) -> str | None:
        """Why ``r`` cannot be admitted now, short of the host pool (the controller says)."""
        if self.engine.active.sum() + len(self.prefilling) >= self.engine.active.size:
            return "slots"
        if self.budget is None:
            return None
        held = self.device_bytes_in_use + self.prefill_bytes_in_use + self.device_bytes(r)
        if held > self.budget:
            return "device_budget"
        if held + self.prefill_bytes(r) > self.budget:
            return "prefill_memory"
        return None

    def _wait(self, r: Request, reason: str) -> None:
        r.admission_waits += 1
        self.admission_waits += 1
        self.waits_by[reason] += 1

    def _engine_admit(self, r: Request, prefilled=None) -> int | None:
        """``engine.admit``, or None when the host pool or the device pools cannot hold
        ``r`` now (it waits)."""
        prefix = self.prefixes.pop(r.session, None) if r.session is not None else None
        try:  # the controller reserves before the engine changes anything
            if prefix is None:
                return self.engine.admit(r, prefilled=prefilled)
            slot = self.engine.admit(r, prefix=prefix)  # checks r extends the prefix
            self.reused_tokens += len(prefix.tokens)
            return slot
        except CapacityError as e:
            if prefix is not None:  # not admitted: the session keeps its prefix
                self.prefixes[r.session] = prefix
            pool = getattr(e, "wait_reason", None) or (
                "device_pool" if isinstance(e, DeviceCapacityError) else "host_pool")
            others = [s for s in self.prefixes if s != r.session]
            if pool == "host_pool" and others:  # evict the oldest other session's prefix
                self.engine.drop(self.prefixes.pop(others[0]))  # (its next call prefills
                self.prefix_drops += 1  # the whole prompt again); r retries next iteration
            elif not self.running:
                raise RuntimeError(f"Scheduler: request {r.id!r} does not fit in the empty "
                                   f"{pool.replace('_', ' ')}; it would wait forever") from None
            self._wait(r, pool)
            return None

    def _stop_reason(self, r: Request) -> str | None:
        """``r.stop_reason``, or "length" once prompt + tokens fill max_len (max_new_tokens
        None)."""
        full = len(r.prompt) + len(r.tokens) >= self.engine.config.model.max_len
        return r.stop_reason or ("length" if full else None)

    def _started(self, slot: int, r: Request, admitted: float, now: float) -> None:
        """``r``, admitted at ``admitted``, entered the engine in ``slot``; its first token is
        out at ``now``."""
        r.admitted_at, r.first_token_at, r.token_times[:] = admitted, now, [now]
        self.running[slot] = r
        if self._stop_reason(r):  # its first token already ends it
            self._finish(slot)

    def _admit(self) -> None:
        """Whole-prompt mode: admits arrived requests in order until one does not fit; that
        one waits."""
        while self.waiting and self.waiting[0].arrival_time <= self.clock.now:
            r = self.waiting[0]
            if reason := self._blocked(r):
                return self._wait(r, reason)
            if not self._admit_whole(r):
                return

    def _admit_whole(self, r: Request) -> bool:
        """Admits ``r`` (the head of the queue, not blocked) with its whole prompt prefilled
        (past its session's prefix, if one is held); False if it must wait."""
        start, t0 = self.clock.now, time.perf_counter()
        reused = self.reused_tokens
        if (slot := self._engine_admit(r)) is None:
            return False
        self._peak = max(self._peak, self.device_bytes_in_use + self.device_bytes(r)
                         + self.prefill_bytes(r))  # while it prefilled
        self.waiting.pop(0)
        prefilled = len(r.prompt) - (self.reused_tokens - reused)  # the suffix, if reused
        now = self.clock.charge(time.perf_counter() - t0, self.clock.prefill_token_s * prefilled)
        self.device_bytes_in_use += self.device_bytes(r)
        self._started(slot, r, start, now)
        return True

    def _admit_chunked(self) -> None:
        """Chunked mode: arrived requests start prefilling in order while a slot and the
        budget allow; then up to the token budget of chunks run, oldest prefill first; then
        finished prefills enter the engine in order (one the host pool cannot hold waits)."""
        cfg = self.engine.config
        while self.waiting and self.waiting[0].arrival_time <= self.clock.now:
            r = self.waiting[0]
            if reason := self._blocked(r):
                self._wait(r, reason)
                break
            if r.session is not None and r.session in self.prefixes:  # a continuation: only
                if not self._admit_whole(r):  # its suffix to prefill, admitted at once
                    break
                continue
            self.waiting.pop(0)
            self.device_bytes_in_use += self.device_bytes(r)
            self.prefill_bytes_in_use += self.prefill_bytes(r)
            self._peak = max(self._peak, self.device_bytes_in_use + self.prefill_bytes_in_use)
            self.prefilling.append(Prefill(r, self._chunks(r), self.clock.now))
        t0, tokens = time.perf_counter(), 0
        calls = max(1, self.prefill_token_budget // cfg.cache.prefill_chunk)
        mix = self.mixed and bool(self.running)  # a decode step follows: one chunk rides on it
        calls -= mix
        for job in self.prefilling:
            while calls and job.result is None:
                calls, tokens = calls - 1, tokens + self._prefilled(job, *next(job.chunks))
        if mix:
            self._mixed = next((job for job in self.prefilling if job.result is None), None)
        self._enter(t0, tokens)

    def _chunks(self, r: Request):
        """``r``'s chunked prefill (``Engine.prefill_chunks``)."""
        chunks = self.engine.prefill_chunks(r.prompt)
        if self.mixed and not isinstance(chunks, PrefillChunks):
            raise TypeError(f"Scheduler: mixed runs chunks of a steps.PrefillChunks; "
                            f"{type(self.engine).__name__}.prefill_chunks gave "
                            f"{type(chunks).__name__}")
        return chunks

    def _prefilled(self, job: Prefill, prefilled, valid: int) -> int:
        """Counts a chunk of ``valid`` tokens that ran for ``job``; returns ``valid``."""
        job.done += valid
        if job.done == len(job.request.prompt):
            job.result = prefilled
        return valid

    def _enter(self, t0: float, tokens: int) -> None:
        """Finished prefills enter the engine in order (one the host pool cannot hold waits);
        the clock is charged the wall time since ``t0`` or ``tokens`` prefilled."""
        entered = []
        while self.prefilling and self.prefilling[0].result is not None:
            job = self.prefilling[0]
            if (slot := self._engine_admit(job.request, job.result)) is None:
                break
            self.prefilling.pop(0)
            self.prefill_bytes_in_use -= self.prefill_bytes(job.request)
            entered.append((slot, job))
        now = self.clock.charge(time.perf_counter() - t0, self.clock.prefill_token_s * tokens)
        for slot, job in entered:
            self._started(slot, job.request, job.started, now)

    def _step_args(self, forced: str = "tokens") -> dict:
        """The decode step's ``prefill`` (its chunk runs inside the step), if mixed, and its
        teacher-forced inputs under the keyword ``forced`` names, if ``inputs``."""
        args = {} if self._mixed is None else {"prefill": self._mixed.chunks}
        if self.inputs is not None:
            slots = self.engine.active.size
            fresh = np.array([self.running.get(s) is not self._fed.get(s)
                              for s in range(slots)])
            self._fed = dict(self.running)
            args[forced] = self.inputs(self.engine.next_token, fresh)
        return args

    def _after_mixed(self) -> None:
        """Counts this iteration's mixed chunk (run alone here if no step ran it: overlap,
        every running request sitting the step out) and admits the prefills done."""
        job, self._mixed = self._mixed, None
        if job is None:
            return
        t0 = time.perf_counter()
        ran = job.chunks.start > job.done  # uncounted tokens (its chunks so far are whole)
        if not ran:
            next(job.chunks)
        self.mixed_iterations += ran
        self._enter(t0, self._prefilled(job, *job.chunks.last))

    def _finish(self, slot: int) -> None:
        """Ends the request in ``slot`` (released, or detached when its session goes on with
        prefix reuse) and submits what the workload sends next."""
        r = self.running.pop(slot)
        r.finish_reason = self._stop_reason(r)
        nxt = [] if self.workload is None else self.workload.on_finish(r, self.clock.now)
        goes_on = (any(n.session == r.session for n in nxt)
                   or r.session in getattr(self.workload, "held_sessions", ()))
        if self.prefix_reuse and r.session is not None and goes_on:
            self.prefixes[r.session] = self.engine.detach(slot)
        else:
            self.engine.release(slot)
        r.finished_at = self.clock.now
        self.device_bytes_in_use -= self.device_bytes(r)
        self.finished.append(r)
        self.submit(nxt)

    def iterate(self) -> None:
        """One scheduler iteration: admissions (and prefill chunks), one decode step,
        releases."""
        self._peak = self.device_bytes_in_use + self.prefill_bytes_in_use
        if self.prefill_token_budget is None:
            self._admit()
        else:
            self._admit_chunked()
        # the peak of this iteration: admissions' prefills, then the step (before releases)
        in_use = max(self._peak, self.device_bytes_in_use + self.prefill_bytes_in_use)
        if self.overlap and (self.running or self._in_flight is not None):
            self._overlapped_step()
        elif self.running:
            t0 = time.perf_counter()
            self.engine.step(**self._step_args())
            now = self.clock.charge(time.perf_counter() - t0, self.clock.step_s or 0.0)
            for slot, r in list(self.running.items()):
                r.token_times[-1] = now
                if self._stop_reason(r):
                    self._finish(slot)
        elif self.waiting and not self.prefilling:  # idle until the next arrival
            self.clock.now = max(self.clock.now, self.waiting[0].arrival_time)
        mixed = self.mixed_iterations
        self._after_mixed()
        self.trace.append({"time_s": self.clock.now, "active": len(self.running),
                           "mixed": self.mixed_iterations > mixed,
                           "prefilling": len(self.prefilling),
                           "waiting": sum(1 for _ in itertools.takewhile(  # arrived ones
                               lambda r: r.arrival_time <= self.clock.now, self.waiting)),
                           "device_bytes": in_use,
                           "prefix_host_bytes": sum(p.host_bytes
                                                    for p in self.prefixes.values())})

    def _overlapped_step(self) -> None:
        """Overlap mode: launch the next step of the running requests that have room, then
        read the previous step back and finish the requests it ended."""
        t0 = time.perf_counter()
        engine, prev = self.engine, self._in_flight
        # a request's last token (max_new_tokens or max_len) is the one a step at length
        # limit - 2 samples: from there on it sits out (finished when that token is read)
        last = engine.lengths + 1 >= engine.limit
        room = engine.active & ~last
        self._in_flight = (engine.launch(prev, skip=last, **self._step_args("forced"))
                           if room.any() else None)
        if prev is not None:
            before = {slot: len(r.tokens) for slot, r in self.running.items()}
            engine.collect(prev)
            now = self.clock.charge(time.perf_counter() - t0, self.clock.step_s or 0.0)
            for slot, r in list(self.running.items()):
                if len(r.tokens) > before[slot]:
                    r.token_times[-1] = now
                if self._stop_reason(r):
                    self._finish(slot)
        else:  # the first step of a run: nothing to read yet
            self.clock.charge(time.perf_counter() - t0, 0.0)

    def run(self, progress=None) -> list[Request]:
        """Iterates until every submitted request finished; returns them in finishing order.
        progress: a tqdm-like bar (total = requests), updated with live aggregates."""
        live = {}
        while self.waiting or self.prefilling or self.running or self._in_flight is not None:
            done = len(self.finished)
            self.iterate()
            if progress is not None:
                if len(self.finished) > done:  # aggregates change only when one finishes
                    progress.update(len(self.finished) - done)
                    live = self._live()
                progress.set_postfix(live | {"active": len(self.running),
                                             "waits": self.admission_waits}, refresh=False)
        return self.finished

    # -------------------------------------------------------------------------------- metrics
    def records(self) -> list[dict]:
        """Per finished request: lengths, timestamps, TTFT, TPOT, end-to-end (seconds)."""
        return [request_metrics(r) | {"device_bytes": self.device_bytes(r)}
                for r in self.finished]

    def summary(self) -> dict:
        """Aggregates (``metrics.summarize``) plus admission waits, iterations, the peak of
        the device bytes in use and the steady iteration time (``metrics.steady_state``)."""
        return summarize(self.records()) | {
            "reused_prefix_tokens": self.reused_tokens, "prefix_drops": self.prefix_drops,
            "admission_waits": self.admission_waits, "waits_by": dict(self.waits_by),
            "iterations": len(self.trace), "mixed_iterations": self.mixed_iterations,
            "device_budget_bytes": self.budget,
            "prefill_memory": self.prefill_memory,
            "memory_model_layers": (None if self.memory_model is None
                                    else self.memory_model.model.num_layers),
            "peak_device_bytes": max((t["device_bytes"] for t in self.trace), default=0),
            **steady_state(self.trace)}

    def _live(self) -> dict:
        s = summarize([request_metrics(r) for r in self.finished])
        fmt = lambda v, scale=1.0: "-" if v is None else f"{v * scale:.3g}"  # noqa: E731
        return {"ttft_p50_s": fmt(s["ttft_p50_s"]), "tpot_p50_ms": fmt(s["tpot_p50_s"], 1e3),
                "tok/s": fmt(s["throughput_tok_s"])}


def _check_mixed(engine: Engine, prefill_token_budget: int | None) -> None:
    """Mixed iterations fuse a prefill chunk into the plain engine's decode step."""
    if prefill_token_budget is None:
        raise ValueError("Scheduler: mixed runs prefill chunks inside decode steps; it needs "
                         "chunked prefill (set prefill_token_budget)")
    if type(engine).step is not Engine.step:
        raise ValueError(f"Scheduler: mixed fuses a chunk into Engine's decode step; "
                         f"{type(engine).__name__} runs its own step")
    check_mixed(engine.config)


def _check_memory_model(engine: Engine, memory: EngineConfig) -> None:
    """A memory model may deepen the served model, nothing else (its bytes would otherwise
    describe another engine)."""
    served = engine.config
    model = dataclasses.replace(memory.model, layer_pattern=served.model.layer_pattern,
                                max_len=served.model.max_len)
    if dataclasses.replace(memory, model=model) != served:
        raise ValueError("Scheduler: memory_model must equal the engine's config except for "
                         "the model's layer_pattern and max_len")
    if served.cache.device_pages is not None:
        raise ValueError("Scheduler: memory_model counts a byte budget; device pools "
                         "(CacheConfig.device_pages) admit by the engine's own pages")
    if type(engine).request_device_bytes is not Engine.request_device_bytes:
        raise ValueError(f"Scheduler: memory_model counts a plain engine's bytes; "
                         f"{type(engine).__name__} adds its own")


__all__ = ["Clock", "Scheduler", "WAIT_REASONS"]
