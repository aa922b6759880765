"""A request to the engine: its prompt, how to decode it, when to stop, and the timestamps the
engine (and a scheduler) fill in."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from lsparse_jax.tasks import tokenizer

_IDS = itertools.count()


@dataclasses.dataclass
class Request:
    """One generation request.

    Attributes:
      prompt: token ids [n] (n >= 1).
      max_new_tokens: tokens to generate at most (the first sampled token counts); None = up to
        the model's max_len. The engine reserves prompt + max_new_tokens for it at admission.
      stop_tokens: generation ends after any of these token ids (e.g. EOS), which is kept.
      stop_strings: generation ends once the decoded output (``tasks.tokenizer``) contains
        any of these strings (kept).
      arrival_time: when the request arrived (seconds, the caller's clock; a scheduler's
        queue orders by it).
      id: a caller-chosen identifier (default: a process-wide counter).
      session: the multi-turn session the request is a call of (None: a single request);
        turn: its call index in the session (``serving.workloads``).
    Filled by the engine (``time.perf_counter`` seconds): admitted_at, first_token_at,
    finished_at; ``tokens`` the generated ids; ``token_times`` the time each was produced.
    A scheduler (``serving.scheduler``) restamps them on its clock and fills admission_waits
    (iterations the request waited for capacity after arriving) and finish_reason.
    """

    prompt: Sequence[int]
    max_new_tokens: int | None = None
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    arrival_time: float = 0.0
    id: int | str = dataclasses.field(default_factory=lambda: next(_IDS))
    session: int | str | None = None
    turn: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    admission_waits: int = 0
    finish_reason: str | None = None

    def __post_init__(self):
        self.prompt = np.asarray(self.prompt, np.int32).reshape(-1)
        if self.prompt.size == 0:
            raise ValueError(f"Request {self.id!r}: the prompt is empty")
        if self.max_new_tokens is not None and (
                not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
                or self.max_new_tokens < 1):
            raise ValueError(f"Request {self.id!r}: max_new_tokens={self.max_new_tokens!r} must "
                             "be a positive int or None")
        self.stop_tokens = tuple(int(t) for t in self.stop_tokens)
        if isinstance(self.stop_strings, str) or not all(self.stop_strings):
            raise ValueError(f"Request {self.id!r}: stop_strings={self.stop_strings!r} must be "
                             "a sequence of non-empty strings")
        self.stop_strings = tuple(self.stop_strings)

    @property
    def stop_reason(self) -> str | None:
        """Why generation ends now: "stop_token", "stop_string", "length" (max_new_tokens),
        or None while it goes on."""
        if self.tokens and self.tokens[-1] in self.stop_tokens:
            return "stop_token"
        if self.tokens and self.stop_strings:
            text = tokenizer.decode(self.tokens)
            if any(s in text for s in self.stop_strings):
                return "stop_string"
        if self.max_new_tokens is not None and len(self.tokens) >= self.max_new_tokens:
            return "length"
        return None

    @property
    def done(self) -> bool:
        """Generation reached max_new_tokens, a stop token or a stop string."""
        return self.stop_reason is not None


__all__ = ["Request"]
