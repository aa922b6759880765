"""Workloads for the scheduler: open-loop Poisson arrivals, closed-loop clients, and
multi-turn sessions from a synthetic generator.

A workload is a value with two methods the scheduler calls (``Scheduler(workload=...)``):
``initial() -> list[Request]`` (submitted at the start) and ``on_finish(request, now) ->
list[Request]`` (submitted when ``request`` finishes at scheduler time ``now``; their arrival
times are >= now). Open-loop arrivals return nothing on finish; closed-loop clients and
sessions return their next request, so their arrivals depend on service.

Multi-turn sessions (the LeanSparse replay's shape): the paper replays NVIDIA's Open-SWE
traces (recorded prompts, output lengths, tool waits); they are not available offline, so the
calls come from a documented synthetic generator instead (``MultiTurn``): each call's prompt is
the previous call's prompt + its response + a new turn (random token ids standing for the
tool output and the next instruction), after a tool wait. Every draw of a session comes from
its own generator seeded by (seed, session), so a session's turns do not depend on the order
in which calls finish.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lsparse_jax.serving.request import Request


def poisson_requests(n: int, rate: float, prompt_tokens, max_new_tokens, vocab: int,
                     seed: int, stop_strings=()) -> list[Request]:
    """n requests, arrivals a Poisson process of ``rate``/s (exponential gaps from 0), prompt
    and output lengths uniform on the inclusive ranges (lo, hi)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    lengths = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, n)
    outputs = rng.integers(max_new_tokens[0], max_new_tokens[1] + 1, n)
    return [Request(rng.integers(0, vocab, int(lengths[i])).astype(np.int32), int(outputs[i]),
                    stop_strings=tuple(stop_strings), arrival_time=float(arrivals[i]), id=i)
            for i in range(n)]


@dataclasses.dataclass
class OpenLoop:
    """A fixed list of requests (e.g. ``poisson_requests``); finishing adds none."""

    requests: Sequence[Request]

    def initial(self) -> list[Request]:
        return list(self.requests)

    def on_finish(self, request: Request, now: float) -> list[Request]:
        return []


@dataclasses.dataclass
class ClosedLoop:
    """C clients at fixed input and output lengths: each submits its first request at time 0
    and its next one ``think_s`` after its previous one finishes, ``requests_per_client``
    in all (concurrency level C: the load never exceeds C requests)."""

    clients: int
    input_tokens: int
    output_tokens: int
    requests_per_client: int
    vocab: int
    think_s: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("clients", "input_tokens", "output_tokens", "requests_per_client"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ClosedLoop.{name}={value!r} must be a positive int")
        if self.think_s < 0:
            raise ValueError(f"ClosedLoop.think_s={self.think_s!r} must be >= 0")
        self._sent = [0] * self.clients

    def _request(self, client: int, arrival: float) -> Request:
        n = self._sent[client]
        self._sent[client] += 1
        rng = np.random.default_rng((self.seed, client, n))
        return Request(rng.integers(0, self.vocab, self.input_tokens).astype(np.int32),
                       self.output_tokens, arrival_time=arrival, id=f"c{client}.{n}",
                       session=client, turn=n)

    def initial(self) -> list[Request]:
        return [self._request(c, 0.0) for c in range(self.clients)]

    def on_finish(self, request: Request, now: float) -> list[Request]:
        client = request.session
        if self._sent[client] >= self.requests_per_client:
            return []
        return [self._request(client, now + self.think_s)]


@dataclasses.dataclass
class MultiTurn:
    """Synthetic multi-turn sessions (stand-in for the Open-SWE traces, not available offline).

    Sessions start as a Poisson process of ``session_rate`` per second. Session s's call 0
    has a prompt of ``first_prompt_tokens`` (uniform, inclusive range) random tokens; call
    i > 0 arrives a tool wait (exponential, mean ``tool_wait_s``) after call i - 1 finishes,
    with prompt = call i-1's prompt + its response + a new turn of ``turn_tokens`` (uniform)
    random tokens; every call asks for ``output_tokens`` (uniform) new tokens. A session
    ends after ``calls`` calls, or earlier when the next call would not fit ``max_len``
    (prompt + output; counted in ``truncated``). Turn 0 is the warmup prefill of the
    paper's replay (its window starts after it): ``session_records`` and the replay
    statistics measure calls with turn >= 1. ``warmup_first``: the paper's warmup prefills
    run outside the measured interval: every call 0 arrives at time 0, and the sessions'
    Poisson starts apply to their calls 1, counted from the moment the last call 0 finished
    (a session's tool wait after its call 0 is not drawn).
    """

    sessions: int
    calls: int
    first_prompt_tokens: tuple[int, int]
    turn_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    vocab: int
    max_len: int
    session_rate: float = 2.0
    tool_wait_s: float = 1.0
    seed: int = 0
    warmup_first: bool = False

    def __post_init__(self):
        if self.sessions < 1 or self.calls < 1:
            raise ValueError(f"MultiTurn: sessions={self.sessions} and calls={self.calls} "
                             "must be >= 1")
        for name in ("first_prompt_tokens", "turn_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"MultiTurn.{name}={(lo, hi)!r} must be 1 <= lo <= hi")
        if self.first_prompt_tokens[1] + self.output_tokens[1] > self.max_len:
            raise ValueError(f"MultiTurn: a first call of up to {self.first_prompt_tokens[1]}"
                             f" + {self.output_tokens[1]} tokens exceeds max_len={self.max_len}")
        self._rngs = [np.random.default_rng((self.seed, s)) for s in range(self.sessions)]
        starts = np.random.default_rng((self.seed, self.sessions, 1)).exponential(
            1.0 / self.session_rate, self.sessions)
        self.starts = np.cumsum(starts) - starts[0]  # the first session at time 0
        self.truncated = 0
        self._held: list[Request] = []  # warmup_first: calls 1 until every call 0 finished
        self._warming = self.sessions

    def _uniform(self, s: int, bounds) -> int:
        return int(self._rngs[s].integers(bounds[0], bounds[1] + 1))

    def _call(self, s: int, turn: int, prompt: np.ndarray, arrival: float) -> Request:
        return Request(prompt, self._uniform(s, self.output_tokens), arrival_time=arrival,
                       id=f"s{s}.{turn}", session=s, turn=turn)

    def initial(self) -> list[Request]:
        calls = []
        for s in range(self.sessions):
            n = self._uniform(s, self.first_prompt_tokens)
            start = 0.0 if self.warmup_first else float(self.starts[s])
            calls.append(self._call(s, 0, self._rngs[s].integers(0, self.vocab, n)
                                    .astype(np.int32), start))
        return calls

    def on_finish(self, request: Request, now: float) -> list[Request]:
        turn = request.turn + 1
        calls = [] if turn >= self.calls else self._next(request, now)
        if not (self.warmup_first and turn == 1):
            return calls
        self._held += calls
        self._warming -= 1
        if self._warming:
            return []
        for call in self._held:  # the measured window opens now
            call.arrival_time = now + float(self.starts[call.session])
        out, self._held = self._held, []
        return out

    @property
    def held_sessions(self) -> set:
        """Sessions whose next call is made but held back (warmup_first, before the window
        opens): they go on, so a scheduler keeps their prefixes."""
        return {c.session for c in self._held}

    def _next(self, request: Request, now: float) -> list[Request]:
        """The call after ``request`` (none when it would not fit max_len)."""
        s, turn = request.session, request.turn + 1
        rng = self._rngs[s]
        new = rng.integers(0, self.vocab, self._uniform(s, self.turn_tokens)).astype(np.int32)
        prompt = np.concatenate([request.prompt, np.asarray(request.tokens, np.int32), new])
        warm = self.warmup_first and turn == 1
        wait = (float(rng.exponential(self.tool_wait_s)) if self.tool_wait_s > 0 and not warm
                else 0.0)
        call = self._call(s, turn, prompt, now + wait)
        if len(prompt) + call.max_new_tokens > self.max_len:
            self.truncated += 1
            return []
        return [call]


def session_records(records: Sequence[dict], from_turn: int = 0) -> list[dict]:
    """Per session (records with a session, calls of turn >= ``from_turn``): calls, first
    arrival, last finish and session time = last finish - first arrival (tool waits
    included)."""
    by: dict = {}
    for r in records:
        if r["session"] is not None and r["turn"] >= from_turn:
            by.setdefault(r["session"], []).append(r)
    out = []
    for s, calls in by.items():
        first = min(c["arrival_s"] for c in calls)
        last = max(c["finished_s"] for c in calls)
        out.append({"session": s, "calls": len(calls), "first_arrival_s": first,
                    "last_finish_s": last, "session_s": last - first})
    return out


__all__ = ["ClosedLoop", "MultiTurn", "OpenLoop", "poisson_requests", "session_records"]


@dataclasses.dataclass
class RepeatInputs:
    """Teacher-forced decode inputs with a tunable step-to-step selection reuse.

    With random weights a decode step's selection shares ~1-7% of its positions with the
    previous step's (``metrics()["selection"]["reuse_fraction"]``), where the trained small
    model shows 0.267 (README "Selection realism"): every cache then looks worse than it would
    serve. Repeating a slot's previous input token keeps its indexer query close to the last
    one (only the position moves), so the selection repeats too: at each step every slot's
    input is its previous input with probability ``repeat``, else a uniform token. Tiny model,
    hisparse, 1.5K context (CPU): reuse 0.069 / 0.29 / 0.61 / 0.68 at repeat 0 / 0.5 / 0.8 /
    1. Calibrate ``repeat`` at the shapes of a run against the reuse it reports.

    Use: ``inputs = RepeatInputs(0.5, vocab); engine.step(tokens=inputs(engine.next_token))``
    each step (the first call starts from the given tokens), or
    ``engine.decode(n, inputs.block(n, engine.next_token))``; ``experiments.common.timed_steps``
    takes ``input_repeat``.
    """

    repeat: float
    vocab: int
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.repeat <= 1.0:
            raise ValueError(f"RepeatInputs: repeat={self.repeat} must be in [0, 1]")
        if self.vocab < 1:
            raise ValueError(f"RepeatInputs: vocab={self.vocab} must be >= 1")
        self._rng = np.random.default_rng(self.seed)
        self._last = None

    def __call__(self, start: np.ndarray, fresh: np.ndarray | None = None) -> np.ndarray:
        """The next step's input per slot ([S] int32); ``start`` seeds the first call, and
        later the slots in ``fresh`` ([S] bool: a new request since the last call, e.g.
        ``Scheduler(inputs=...)``), which repeat their own token, not the slot's last one."""
        start = np.asarray(start, np.int32)
        if fresh is not None and np.shape(fresh) != start.shape:
            raise ValueError(f"RepeatInputs: fresh {np.shape(fresh)} must match start "
                             f"{start.shape}")
        prev = start if self._last is None else self._last
        if fresh is not None and self._last is not None:
            prev = np.where(fresh, start, prev)
        new = self._rng.integers(0, self.vocab, prev.shape)
        self._last = np.where(self._rng.random(prev.shape) < self.repeat, prev,
                              new).astype(np.int32)
        return self._last

    def block(self, n: int, start: np.ndarray) -> np.ndarray:
        """The next ``n`` steps' inputs [n, S] (``Engine.decode(n, inputs)``): the same
        sequence as ``n`` calls."""
        return np.stack([self(start) for _ in range(n)])
