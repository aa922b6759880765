"""MRCR-style multi-round coreference prompts over byte tokens.

A conversation of regular rounds (all ASCII, so byte offsets equal character offsets)::

    User: write a <kind> about <topic>\\nBot: <body>\\n        needle round
    User: tell me about <word>\\nBot: <filler words>\\n         filler round
    ...
    User: repeat the <ordinal> <kind> about <topic>\\nBot:      final query (ends with "Bot: ")

``num_same`` needle rounds share the asked kind+topic; the query asks for the ``ordinal``-th of
them (in conversation order) and the answer is that round's body plus "\\n". The other needle
rounds have a different (kind, topic) pair (they may share the kind or the topic alone). There is
always at least one filler round; filler rounds are interleaved with the needle rounds at random
positions and one filler body is cut (or grown) so the prompt is exactly ``length`` bytes.

Bodies (``body=``): "titled" (the default) restates the request before three words, e.g.
"riddle about cats: nectar timber pepper" (the key sits next to the response, as in NIAH);
"words" is the three words alone, drawn from BODY_WORDS (32 words, none of them a filler word,
first two letters distinct); "letters" is the original 8 random lowercase letters (every MRCR
figure before session 6, and the training data of the shipped checkpoints, used it).
Why words: a byte-level model copies a response through
CSA's compressed entries (4 tokens each); 8 random letters are 8 independent 1-of-26 choices to
read out of ~3 entries, and the trained small model never learned it (0.03 per-letter accuracy
teacher forced, i.e. chance), while a word is one 1-of-32 choice per ~6 bytes that the model
can complete once its first letters are out, as a language model copies natural text (the
real MRCR's responses are natural text too).
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from lsparse_jax.tasks import tokenizer
from lsparse_jax.tasks.niah import _WORDS, filler

KINDS = ("poem", "note", "story", "joke", "riddle")
TOPICS = ("cats", "rain", "ships", "tea", "stars", "bread", "music", "snow")
ORDINALS = ("1st", "2nd", "3rd", "4th")
BODY_WORDS = ("amber", "bishop", "copper", "dolphin", "ember", "falcon", "garnet", "harbor",
              "indigo", "jasper", "kettle", "lantern", "marble", "nectar", "orchid", "pepper",
              "quartz", "violet", "saddle", "timber", "umpire", "velvet", "walnut", "yonder",
              "zephyr", "anchor", "blossom", "cinder", "dusk", "eclipse", "fjord", "glacier")
BODY_NUM_WORDS = 3
LETTERS_LEN = 8  # body="letters": this many random lowercase letters
BODIES = ("titled", "words", "letters")
_WORDS_LEN = BODY_NUM_WORDS * (max(map(len, BODY_WORDS)) + 1) - 1
# the longest body of each style (bytes, without the "\n")
MAX_BODY_LEN = {"titled": len(f"{max(KINDS, key=len)} about {max(TOPICS, key=len)}: ") + _WORDS_LEN,
                "words": _WORDS_LEN, "letters": LETTERS_LEN}
_FILLER_OVERHEAD = len("User: tell me about \nBot: \n")  # + len(word) + len(body)
# Smallest filler round that is always possible: the longest word and a one-byte body.
_MIN_FILLER_ROUND = _FILLER_OVERHEAD + max(map(len, _WORDS)) + 1


@dataclasses.dataclass(frozen=True)
class MrcrExample:
    prompt: np.ndarray  # [T] int32 byte tokens, exactly `length`, ending right after "Bot: "
    answer: str  # the asked round's body + "\n"
    round_offsets: tuple[int, ...]  # byte offset where each needle round ("User: write ...") starts
    target_round: int  # index into round_offsets of the asked round
    kind: str
    topic: str
    ordinal: int  # 1-based: the asked round is the ordinal-th round of (kind, topic)


def needle_round(kind: str, topic: str, body: str) -> str:
    return f"User: write a {kind} about {topic}\nBot: {body}\n"


def query(ordinal: int, kind: str, topic: str) -> str:
    return f"User: repeat the {ORDINALS[ordinal - 1]} {kind} about {topic}\nBot: "


def make_body(rng: np.random.Generator, body: str) -> str:
    """One response body of style ``body`` (module docstring)."""
    if body in ("words", "titled"):  # (titled: the title is added by mrcr_example)
        return " ".join(BODY_WORDS[i] for i in rng.integers(len(BODY_WORDS), size=BODY_NUM_WORDS))
    if body == "letters":
        return "".join(rng.choice(list(string.ascii_lowercase), LETTERS_LEN))
    raise ValueError(f"mrcr: body={body!r} must be one of {BODIES}")


def min_length(num_rounds: int = 4, body: str = "titled") -> int:
    """A seed-independent length that is always long enough for ``num_rounds`` needle rounds."""
    if body not in BODIES:
        raise ValueError(f"mrcr.min_length: body={body!r} must be one of {BODIES}")
    longest = needle_round(max(KINDS, key=len), max(TOPICS, key=len), "x" * MAX_BODY_LEN[body])
    q = query(1, max(KINDS, key=len), max(TOPICS, key=len))
    return num_rounds * len(longest) + len(q) + _MIN_FILLER_ROUND


def _filler_rounds(rng: np.random.Generator, total: int) -> list[str]:
    """Filler rounds of exactly ``total`` bytes in all (requires total >= _MIN_FILLER_ROUND)."""
    rounds, left = [], total
    while True:
        word = _WORDS[rng.integers(len(_WORDS))]
        body = " ".join(_WORDS[i] for i in rng.integers(len(_WORDS), size=rng.integers(3, 11)))
        r = f"User: tell me about {word}\nBot: {body}\n"
        if left - len(r) >= _MIN_FILLER_ROUND:  # room for at least one more round after it
            rounds.append(r)
            left -= len(r)
            continue
        # Last round: its body takes exactly what is left (>= 1 byte since left >= minimum).
        body = filler(rng, left - _FILLER_OVERHEAD - len(word))
        rounds.append(f"User: tell me about {word}\nBot: {body}\n")
        return rounds


def mrcr_example(length: int, *, num_rounds: int = 4, num_same: int = 2,
                 seed: int = 0, body: str = "titled") -> MrcrExample:
    """A conversation of exactly ``length`` byte tokens with ``num_rounds`` needle rounds, of
    which ``num_same`` share the asked kind+topic; the query asks for one of those by ordinal
    and the prompt ends where the answer (body + "\\n") begins."""
    if not 1 <= num_same <= len(ORDINALS):
        raise ValueError(f"mrcr_example: num_same={num_same} must lie in [1, {len(ORDINALS)}]")
    if body not in BODIES:
        raise ValueError(f"mrcr_example: body={body!r} must be one of {BODIES}")
    if num_rounds < num_same:
        raise ValueError(f"mrcr_example: num_rounds={num_rounds} must be >= num_same={num_same}")
    rng = np.random.default_rng(seed)
    kind, topic = KINDS[rng.integers(len(KINDS))], TOPICS[rng.integers(len(TOPICS))]
    others = [(k, t) for k in KINDS for t in TOPICS if (k, t) != (kind, topic)]
    pairs = [(kind, topic)] * num_same + [others[i] for i in
                                          rng.integers(len(others), size=num_rounds - num_same)]
    pairs = [pairs[i] for i in rng.permutation(num_rounds)]
    bodies: list[str] = []
    while len(bodies) < num_rounds:  # distinct bodies keep the answer unambiguous
        b = make_body(rng, body)
        if b not in bodies:
            bodies.append(b)
    if body == "titled":
        bodies = [f"{k} about {t}: {b}" for (k, t), b in zip(pairs, bodies)]
    ordinal = int(rng.integers(1, num_same + 1))
    same = [i for i, p in enumerate(pairs) if p == (kind, topic)]
    target = same[ordinal - 1]
    needles = [needle_round(k, t, b) for (k, t), b in zip(pairs, bodies)]
    q = query(ordinal, kind, topic)
    fixed = sum(map(len, needles)) + len(q)
    if length - fixed < _MIN_FILLER_ROUND:
        raise ValueError(f"mrcr_example: length={length} is too short: {num_rounds} needle rounds "
                         f"and the query take {fixed} bytes and at least one filler round needs "
                         f"{_MIN_FILLER_ROUND} more (length >= "
                         f"{min_length(num_rounds, body)} always suffices)")
    fill = _filler_rounds(rng, length - fixed)
    slots = set(rng.choice(num_rounds + len(fill), num_rounds, replace=False).tolist())
    parts, offsets, size, ni, fi = [], [], 0, 0, 0
    for s in range(num_rounds + len(fill)):
        if s in slots:
            offsets.append(size)
            part, ni = needles[ni], ni + 1
        else:
            part, fi = fill[fi], fi + 1
        parts.append(part)
        size += len(part)
    prompt = tokenizer.encode("".join(parts) + q)
    assert len(prompt) == length, (len(prompt), length)
    return MrcrExample(prompt, bodies[target] + "\n", tuple(offsets), target, kind, topic, ordinal)
