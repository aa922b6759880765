"""Needle-in-a-haystack prompts (RULER-style multi-key) over byte tokens."""

from __future__ import annotations

import dataclasses

import numpy as np

from lsparse_jax.tasks import tokenizer
from lsparse_jax.tasks.scoring import score_exact  # noqa: F401  (re-exported, moved)

_WORDS = ("the river carried small stones past quiet fields while birds circled over old "
          "barns and a farmer counted sheep near the fence before the evening rain began to "
          "fall on roofs gardens and roads that led toward the distant hills").split()


@dataclasses.dataclass(frozen=True)
class NiahExample:
    prompt: np.ndarray  # [T] int32 byte tokens, ending right before the answer
    answer: str  # the queried needle's value
    needle_offsets: tuple[int, ...]  # byte offset where each needle sentence starts
    query_key: str


def filler(rng: np.random.Generator, num_bytes: int) -> str:
    words, size = [], 0
    while size <= num_bytes:  # the join drops one trailing space
        w = _WORDS[rng.integers(len(_WORDS))]
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:num_bytes]


def needle(key: str, value: str) -> str:
    return f" The magic number for {key} is {value}. "


def niah_example(length: int, *, num_needles: int = 1, seed: int = 0,
                 value_digits: int = 6) -> NiahExample:
    """A prompt of exactly ``length`` byte tokens with ``num_needles`` key/value needles at
    random depths; the query names one key and the prompt ends where its value begins."""
    rng = np.random.default_rng(seed)
    keys = [f"{w}-{rng.integers(100, 999)}" for w in rng.choice(_WORDS, num_needles, replace=False)]
    values = ["".join(map(str, rng.integers(0, 10, value_digits))) for _ in keys]
    pick = int(rng.integers(num_needles))
    query = f"\nQuestion: what is the magic number for {keys[pick]}? Answer: " \
            f"The magic number for {keys[pick]} is "
    needles = [needle(k, v) for k, v in zip(keys, values)]
    hay = length - len(query) - sum(map(len, needles))
    if hay < num_needles + 1:
        raise ValueError(f"niah_example: length={length} is too short for {num_needles} needles")
    cuts = np.sort(rng.choice(np.arange(1, hay), num_needles, replace=False))
    text = filler(rng, hay)
    parts, offsets, prev, size = [], [], 0, 0
    for cut, ndl in zip(cuts, needles):
        parts.append(text[prev:cut])
        size += cut - prev
        offsets.append(int(size))
        parts.append(ndl)
        size += len(ndl)
        prev = cut
    parts.append(text[prev:])
    prompt = "".join(parts) + query
    return NiahExample(tokenizer.encode(prompt), values[pick], tuple(offsets), keys[pick])
