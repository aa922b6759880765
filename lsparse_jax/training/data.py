"""Training batches from the task generators: whole examples of one fixed length.

Each sequence holds T + 1 tokens; the model reads the first T and predicts the last T. A NIAH
training sequence is a task prompt, its answer, and then up to ``extra_queries`` more
question/answer pairs about the prompt's other needles (more retrieval events per sequence:
a single 4-digit answer per 1K tokens is too little signal for a small model to discover
retrieval); the rest is padding with loss weight 0. With ``mrcr_extra_queries`` an MRCR training
sequence is a conversation of 2-6 request rounds (1-4 of the asked kind and topic) whose query
round is followed by up to that many more "repeat the <n-th> <kind> about <topic>" rounds, each
answered (every needle round can be asked: one answer per conversation is too little signal).
Evaluation uses the plain task format.
Training examples use seeds >= TRAIN_SEED_BASE, evaluation seeds below it, so no evaluation
example is seen in training.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from lsparse_jax.tasks import TASKS, example, tokenizer
from lsparse_jax.tasks.mrcr import (
    KINDS,
    MAX_BODY_LEN,
    ORDINALS,
    TOPICS,
    min_length,
    mrcr_example,
    query,
)

TRAIN_SEED_BASE = 1_000_000_000  # evaluation seeds are < this
NIAH_DIGITS = 4  # tasks.example's NIAH values
_NEEDLE = re.compile(r" The magic number for (\S+) is (\d+)\. ")
_ROUND = re.compile(r"User: write a (\w+) about (\w+)\nBot: ([a-z :]+)\n")
MRCR_ANSWER = max(MAX_BODY_LEN.values()) + 1  # the longest MRCR answer (body + "\n")
# the longest "repeat" round (query + body + newline) an MRCR training sequence can append
_MRCR_QA = len(query(len(ORDINALS), max(KINDS, key=len), max(TOPICS, key=len))) + MRCR_ANSWER


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, T] int32 inputs
    targets: np.ndarray  # [B, T] int32 next tokens
    weights: np.ndarray  # [B, T] f32 loss weight of each target (answers weigh more, pad 0)
    answer_mask: np.ndarray  # [B, T] bool targets that belong to an answer


def task_example(task: str, length: int, seed: int, num_needles: int | None = None):
    """A prompt of ``length`` tokens (an object with .prompt and .answer) of ``task``.

    NIAH: ``num_needles`` (default 1 + seed % 4) needles with 4-digit values. MRCR: 4 request
    rounds, 2 of them of the asked kind and topic (``tasks.example``).
    """
    if task == "niah" and num_needles is None:
        num_needles = 1 + seed % 4
    return example(task, length, seed, num_needles)


def _qa(key: str, value: str) -> tuple[str, str]:
    return (f".\nQuestion: what is the magic number for {key}? Answer: The magic number for "
            f"{key} is ", value)


def _padded(parts, flags, length):
    """(tokens, answer mask, real mask) of the concatenated parts, space-padded to length."""
    seq = np.concatenate(parts)
    answer = np.concatenate([np.full(len(p), f) for p, f in zip(parts, flags)])
    if seq.shape[0] > length:
        raise AssertionError(f"training sequence of {seq.shape[0]} > {length} tokens")
    real = np.ones(length, bool)
    real[seq.shape[0]:] = False
    pad = length - seq.shape[0]
    return (np.concatenate([seq, np.full(pad, ord(" "), np.int32)]),
            np.concatenate([answer, np.zeros(pad, bool)]), real)


def mrcr_training_sequence(length: int, seed: int, extra_queries: int):
    """An MRCR conversation with more answered "repeat" rounds (module docstring).

    Notation: R needle rounds (2..6), S of them share the asked kind and topic (1..min(4, R)).
    The first query is the task's own; each extra one asks a needle round not yet asked, by
    its ordinal among the rounds of its (kind, topic) in conversation order.
    Returns (tokens [length] int32, answer mask [length] bool, weight mask [length] bool).
    """
    rng = np.random.default_rng([seed, 1])
    rounds = int(rng.integers(2, 7))
    while extra_queries and min_length(2) + extra_queries * _MRCR_QA + MRCR_ANSWER > length:
        extra_queries -= 1  # short sequences: fewer extra rounds
    while rounds > 2 and min_length(rounds) + extra_queries * _MRCR_QA + MRCR_ANSWER > length:
        rounds -= 1
    same = int(rng.integers(1, min(len(ORDINALS), rounds) + 1))
    ex = mrcr_example(length - extra_queries * _MRCR_QA - MRCR_ANSWER, num_rounds=rounds,
                      num_same=same, seed=seed)
    found = _ROUND.findall(tokenizer.decode(ex.prompt))
    asked = []  # (ordinal, kind, topic, body) of every needle round
    for i, (kind, topic, body) in enumerate(found):
        ordinal = sum(1 for k, t, _ in found[:i + 1] if (k, t) == (kind, topic))
        if ordinal <= len(ORDINALS) and body + "\n" != ex.answer:
            asked.append((ordinal, kind, topic, body))
    parts, flags = [ex.prompt, tokenizer.encode(ex.answer)], [False, True]
    for i in rng.permutation(len(asked))[:extra_queries]:
        ordinal, kind, topic, body = asked[i]
        parts += [tokenizer.encode(query(ordinal, kind, topic)), tokenizer.encode(body + "\n")]
        flags += [False, True]
    return _padded(parts, flags, length)


def training_sequence(task: str, length: int, seed: int, extra_queries: int,
                      mrcr_extra_queries: int = 0):
    """(tokens [length] int32, answer mask [length] bool, weight mask [length] bool)."""
    rng = np.random.default_rng(seed)
    if task == "mrcr" and mrcr_extra_queries:
        return mrcr_training_sequence(length, seed, mrcr_extra_queries)
    if task != "niah" or extra_queries == 0:  # the plain task format (evaluation's)
        prompt_len = length - _ANSWER_LEN[task]
        if task == "mrcr" and prompt_len < min_length(4):  # short: fewer rounds (2-3)
            rounds = max([2] + [r for r in (2, 3) if min_length(r) <= prompt_len])
            ex = mrcr_example(prompt_len, num_rounds=rounds, seed=seed)
        else:
            ex = task_example(task, prompt_len, seed)
        return _padded([ex.prompt, tokenizer.encode(ex.answer)], [False, True], length)
    needles = int(rng.integers(2, 2 + 2 * extra_queries))
    extra_queries = min(extra_queries, length // 4 // len("".join(_qa("w" * 12, "0000"))))
    reserve = NIAH_DIGITS + extra_queries * len("".join(_qa("w" * 12, "0" * NIAH_DIGITS)))
    ex = task_example("niah", length - reserve, seed, num_needles=needles)
    text = tokenizer.decode(ex.prompt)
    pairs = [(k, v) for k, v in _NEEDLE.findall(text) if k != ex.query_key]
    order = rng.permutation(len(pairs))[:extra_queries]
    parts, flags = [tokenizer.encode(text), tokenizer.encode(ex.answer)], [False, True]
    for i in order:
        q, a = _qa(*pairs[i])
        parts += [tokenizer.encode(q), tokenizer.encode(a)]
        flags += [False, True]
    return _padded(parts, flags, length)


def make_batch(step: int, batch: int, length: int, mix: dict[str, float],
               answer_weight: float, seed: int = 0, held_out: bool = False,
               extra_queries: int = 0, mrcr_extra_queries: int = 0) -> Batch:
    """Batch number ``step`` of a deterministic stream (same arguments, same batch).

    mix: {task: probability}; answer_weight: loss weight of answer targets (others weigh 1,
    padding 0); held_out: example seeds below TRAIN_SEED_BASE (evaluation) instead of above;
    extra_queries: more NIAH question/answer pairs per sequence (0 = the plain task format);
    mrcr_extra_queries: more answered MRCR "repeat" rounds per sequence (0 = plain format).
    """
    for task in mix:
        if task not in TASKS:
            raise ValueError(f"make_batch: unknown task {task!r} in mix; tasks: {TASKS}")
    names = list(mix)
    probs = np.asarray([mix[t] for t in names], np.float64)
    if (probs < 0).any() or probs.sum() <= 0:
        raise ValueError(f"make_batch: mix probabilities must be >= 0 and not all 0: {mix}")
    rng = np.random.default_rng([seed, step, int(held_out)])
    base = 0 if held_out else TRAIN_SEED_BASE
    tokens = np.zeros((batch, length + 1), np.int32)
    answer = np.zeros((batch, length + 1), bool)
    real = np.zeros((batch, length + 1), bool)
    for b in range(batch):
        task = names[rng.choice(len(names), p=probs / probs.sum())]
        ex_seed = base + int(rng.integers(0, TRAIN_SEED_BASE))
        tokens[b], answer[b], real[b] = training_sequence(task, length + 1, ex_seed,
                                                          extra_queries, mrcr_extra_queries)
    weights = np.where(answer[:, 1:], answer_weight, 1.0) * real[:, 1:]
    return Batch(tokens[:, :-1], tokens[:, 1:], weights.astype(np.float32), answer[:, 1:])


# the longest answer of each task: NIAH 4 digits; MRCR the longest body + "\n"
_ANSWER_LEN = {"niah": NIAH_DIGITS, "mrcr": MRCR_ANSWER}
