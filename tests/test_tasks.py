"""Task generators place needles where they say; the scorers score exactly."""

import hashlib
import itertools
import re

import numpy as np
import pytest

from lsparse_jax.tasks import (
    TASKS,
    example,
    mrcr,
    mrcr_example,
    niah,
    niah_example,
    score_exact,
    score_similarity,
    scoring,
    tokenizer,
)


@pytest.mark.parametrize("length,needles,seed", [(300, 1, 0), (2000, 4, 1), (8192, 8, 2)])
def test_niah_places_needles_and_asks_one(length, needles, seed):
    ex = niah_example(length, num_needles=needles, seed=seed)
    text = tokenizer.decode(ex.prompt)
    assert len(ex.prompt) == length
    assert len(ex.needle_offsets) == needles
    found = [text[o:].split(".")[0] for o in ex.needle_offsets]
    assert all(f.startswith(" The magic number for ") for f in found)
    asked = [f for f in found if f" {ex.query_key} is " in f]
    assert len(asked) == 1 and asked[0].endswith(f" is {ex.answer}")
    assert text.endswith(f"The magic number for {ex.query_key} is ")
    assert niah_example(length, num_needles=needles, seed=seed).answer == ex.answer


def test_score_exact():
    assert score_exact("123456. more", "123456") == 1.0
    assert score_exact("123457", "123456") == 0.0
    assert score_exact("", "1") == 0.0


def test_tokenizer_round_trip_and_range():
    s = "needle: 42 \u00e9"
    np.testing.assert_array_equal(tokenizer.encode(s), list(s.encode()))
    assert tokenizer.decode(tokenizer.encode(s)) == s
    with pytest.raises(ValueError, match="token ids must lie in"):
        tokenizer.decode([300])


def test_niah_too_short():
    with pytest.raises(ValueError, match="too short"):
        niah_example(50, num_needles=3)


# ---------------------------------------------------------------------------------------------
# NIAH
# ---------------------------------------------------------------------------------------------

_NEEDLE_RE = re.compile(r" The magic number for (\S+) is (\d+)\. ")


@pytest.mark.parametrize("length,needles,digits,seed",
                         [(400, 1, 6, 0), (401, 2, 4, 3), (1000, 3, 6, 4), (1023, 4, 4, 5),
                          (4096, 8, 6, 6), (4097, 5, 2, 7)])
def test_niah_needle_text_at_each_offset(length, needles, digits, seed):
    ex = niah_example(length, num_needles=needles, seed=seed, value_digits=digits)
    text = tokenizer.decode(ex.prompt)
    assert len(ex.prompt) == length and len(text) == length
    assert list(ex.needle_offsets) == sorted(ex.needle_offsets)
    kv = {}
    for o in ex.needle_offsets:
        m = _NEEDLE_RE.match(text, o)
        assert m is not None, text[o:o + 60]
        key, value = m.groups()
        assert text[o:o + len(niah.needle(key, value))] == niah.needle(key, value)
        assert len(value) == digits and key not in kv
        kv[key] = value
    # Needles do not overlap, and the only other mention of a key is the query.
    ends = [o + len(niah.needle(k, kv[k])) for o, k in zip(ex.needle_offsets, kv)]
    assert all(e <= o for e, o in zip(ends, ex.needle_offsets[1:]))
    assert text.count("The magic number for") == needles + 1
    assert kv[ex.query_key] == ex.answer
    assert text.endswith(f"\nQuestion: what is the magic number for {ex.query_key}? Answer: "
                         f"The magic number for {ex.query_key} is ")


@pytest.mark.parametrize("needles", [1, 2, 4])
def test_niah_exact_length_many_lengths(needles):
    for length in range(380, 1400, 97):
        ex = niah_example(length, num_needles=needles, seed=length)
        assert ex.prompt.shape == (length,) and ex.prompt.dtype == np.int32
        assert len(ex.needle_offsets) == needles


def test_niah_deterministic_and_seeds_differ():
    a = niah_example(1500, num_needles=3, seed=11)
    b = niah_example(1500, num_needles=3, seed=11)
    np.testing.assert_array_equal(a.prompt, b.prompt)
    assert (a.answer, a.needle_offsets, a.query_key) == (b.answer, b.needle_offsets, b.query_key)
    prompts = {niah_example(1500, num_needles=3, seed=s).prompt.tobytes() for s in range(12)}
    assert len(prompts) == 12


def test_niah_text_pinned():
    # Other code depends on the text for a given seed: pin one prompt.
    ex = niah_example(512, num_needles=3, seed=7)
    digest = hashlib.sha256(ex.prompt.astype(np.uint8).tobytes()).hexdigest()
    assert digest == "82e9d0b751a5a6f774dcd7e2c383137cb55854f0066f3e6fac2fc1299b285f5f"
    assert (ex.answer, ex.query_key, ex.needle_offsets) == ("833272", "to-302", (132, 184, 237))


def test_niah_score_exact_still_importable():
    assert niah.score_exact is scoring.score_exact is score_exact


# ---------------------------------------------------------------------------------------------
# MRCR
# ---------------------------------------------------------------------------------------------

_NEEDLE_ROUND_RE = re.compile(r"User: write a (\w+) about (\w+)\nBot: ([a-z]+(?::? [a-z]+)*)\n")
_FILLER_ROUND_RE = re.compile(r"User: tell me about ([a-z]+)\nBot: ([a-z ]+)\n")
_QUERY_RE = re.compile(r"User: repeat the (1st|2nd|3rd|4th) (\w+) about (\w+)\nBot: ")


def _parse_mrcr(text):
    """Split a prompt into rounds: [(offset, 'needle'|'filler', groups)], query groups."""
    rounds, pos = [], 0
    while True:
        for kind, rx in (("needle", _NEEDLE_ROUND_RE), ("filler", _FILLER_ROUND_RE)):
            m = rx.match(text, pos)
            if m:
                rounds.append((pos, kind, m.groups()))
                pos = m.end()
                break
        else:
            break
    q = _QUERY_RE.fullmatch(text, pos)
    assert q is not None, f"unparsed text at {pos}: {text[pos:pos + 80]!r}"
    return rounds, q.groups()


def _check_mrcr(ex, length, num_rounds, num_same):
    text = tokenizer.decode(ex.prompt)
    assert ex.prompt.shape == (length,) and ex.prompt.dtype == np.int32 and len(text) == length
    rounds, (ordinal, kind, topic) = _parse_mrcr(text)
    needles = [(o, g) for o, k, g in rounds if k == "needle"]
    assert any(k == "filler" for _, k, _ in rounds)
    # Offsets point at each needle round, in order, with the stated kind/topic.
    assert ex.round_offsets == tuple(o for o, _ in needles)
    assert len(needles) == num_rounds
    for o, (k, t, body) in needles:
        assert text[o:].startswith(f"User: write a {k} about {t}\nBot: {body}\n")
        assert k in mrcr.KINDS and t in mrcr.TOPICS
    assert (kind, topic) == (ex.kind, ex.topic)
    assert mrcr.ORDINALS.index(ordinal) + 1 == ex.ordinal
    # The asked round is the ordinal-th round of that kind+topic; the answer is its body.
    same = [i for i, (_, (k, t, _)) in enumerate(needles) if (k, t) == (kind, topic)]
    assert len(same) == num_same and 1 <= ex.ordinal <= num_same
    assert ex.target_round == same[ex.ordinal - 1]
    assert ex.answer == needles[ex.target_round][1][2] + "\n"
    assert text[ex.round_offsets[ex.target_round]:].startswith(
        f"User: write a {ex.kind} about {ex.topic}\nBot: {ex.answer}")
    bodies = [g[2] for _, g in needles]
    assert len(set(bodies)) == len(bodies)
    assert text.endswith("\nBot: ")


@pytest.mark.parametrize("length,num_rounds,num_same,seed",
                         [(420, 4, 2, 0), (421, 4, 2, 1), (512, 2, 2, 2), (777, 6, 3, 3),
                          (1024, 8, 4, 4), (1000, 1, 1, 5), (4099, 12, 4, 6), (32768, 4, 2, 7)])
def test_mrcr_structure(length, num_rounds, num_same, seed):
    ex = mrcr_example(length, num_rounds=num_rounds, num_same=num_same, seed=seed)
    _check_mrcr(ex, length, num_rounds, num_same)


@pytest.mark.parametrize("body", mrcr.BODIES)
def test_mrcr_body_styles(body):
    """Bodies are three BODY_WORDS ("words"; "titled": after "<kind> about <topic>: ") or 8
    letters ("letters"), distinct per prompt, and the answer is the asked one's; min_length
    suffices for every style."""
    for seed in range(8):
        ex = mrcr_example(mrcr.min_length(4, body), seed=seed, body=body)
        _check_mrcr(ex, mrcr.min_length(4, body), 4, 2)
        bodies = [g[2] for _, k, g in _parse_mrcr(tokenizer.decode(ex.prompt))[0] if k == "needle"]
        for (k, t, b) in (g for _, kind, g in _parse_mrcr(tokenizer.decode(ex.prompt))[0]
                          if kind == "needle"):
            if body != "letters":
                title = f"{k} about {t}: " if body == "titled" else ""
                assert b.startswith(title)
                words = b.removeprefix(title).split(" ")
                assert len(words) == mrcr.BODY_NUM_WORDS
                assert all(w in mrcr.BODY_WORDS for w in words)
            else:
                assert re.fullmatch(r"[a-z]{8}", b)
        assert ex.answer[:-1] in bodies
    with pytest.raises(ValueError, match="body"):
        mrcr_example(1000, body="digits")


def test_mrcr_exact_length_many_lengths_and_ordinals():
    ordinals = set()
    for i, length in enumerate(range(mrcr.min_length(5), 1500, 37)):
        ex = mrcr_example(length, num_rounds=5, num_same=3, seed=i)
        assert len(ex.prompt) == length
        ordinals.add(ex.ordinal)
    assert ordinals == {1, 2, 3}


def test_mrcr_min_length_boundary():
    for seed in range(6):
        ex = mrcr_example(1000, num_rounds=3, num_same=2, seed=seed)
        text = tokenizer.decode(ex.prompt)
        rounds, _ = _parse_mrcr(text)
        # Bytes that do not depend on the length: the needle rounds and the query.
        fixed = sum(len(mrcr.needle_round(*g)) for _, k, g in rounds if k == "needle")
        fixed += len(mrcr.query(ex.ordinal, ex.kind, ex.topic))
        shortest = fixed + mrcr._MIN_FILLER_ROUND
        assert shortest <= mrcr.min_length(3)
        small = mrcr_example(shortest, num_rounds=3, num_same=2, seed=seed)
        _check_mrcr(small, shortest, 3, 2)
        assert (small.answer, small.kind, small.topic) == (ex.answer, ex.kind, ex.topic)
        with pytest.raises(ValueError, match="too short"):
            mrcr_example(shortest - 1, num_rounds=3, num_same=2, seed=seed)


def test_mrcr_deterministic_and_seeds_differ():
    a = mrcr_example(2048, num_rounds=6, num_same=3, seed=9)
    b = mrcr_example(2048, num_rounds=6, num_same=3, seed=9)
    np.testing.assert_array_equal(a.prompt, b.prompt)
    assert (a.answer, a.round_offsets, a.target_round, a.kind, a.topic, a.ordinal) == \
        (b.answer, b.round_offsets, b.target_round, b.kind, b.topic, b.ordinal)
    exs = [mrcr_example(2048, num_rounds=6, num_same=3, seed=s) for s in range(12)]
    assert len({e.prompt.tobytes() for e in exs}) == 12
    assert len({e.answer for e in exs}) == 12


def test_mrcr_bad_arguments():
    with pytest.raises(ValueError, match="too short"):
        mrcr_example(100)
    with pytest.raises(ValueError, match="num_same"):
        mrcr_example(1000, num_rounds=6, num_same=5)
    with pytest.raises(ValueError, match="num_same"):
        mrcr_example(1000, num_same=0)
    with pytest.raises(ValueError, match="num_rounds"):
        mrcr_example(1000, num_rounds=2, num_same=3)


# ---------------------------------------------------------------------------------------------
# scoring and the task dispatcher
# ---------------------------------------------------------------------------------------------


def test_score_similarity_values():
    answer = "abcdefgh\n"
    assert score_similarity(answer, answer) == 1.0
    assert score_similarity(answer + "User: more text", answer) == 1.0  # truncated first
    assert score_exact(answer + "User:", answer) == 1.0
    # Wrong body: only the "\n" matches -> 2 * 1 / (9 + 9).
    assert score_exact("zzzzzzzz\n", answer) == 0.0
    assert score_similarity("zzzzzzzz\n", answer) == pytest.approx(1 / 9, abs=1e-12)
    # One-letter error: M = 8 -> 2 * 8 / 18.
    s = score_similarity("abcdxfgh\nBot", answer)
    assert 0.0 < s < 1.0 and s == pytest.approx(8 / 9, abs=1e-12)
    assert score_exact("abcdxfgh\n", answer) == 0.0
    # Short output: g = "abcd", M = 4 -> 2 * 4 / (9 + 4).
    assert score_similarity("abcd", answer) == pytest.approx(8 / 13, abs=1e-12)
    assert score_similarity("", answer) == 0.0
    assert score_similarity("anything", "") == 1.0


def test_scores_on_mrcr_answer():
    ex = mrcr_example(600, seed=4)
    assert score_exact(ex.answer + "User: tell", ex.answer) == 1.0
    assert score_similarity(ex.answer, ex.answer) == 1.0
    wrong = "".join("a" if c != "a" else "b" for c in ex.answer[:-1]) + "\n"
    assert score_exact(wrong, ex.answer) == 0.0 and score_similarity(wrong, ex.answer) < 1.0


def test_example_dispatch():
    assert TASKS == ("niah", "mrcr")
    counts = set()
    for seed in range(24):
        ex = example("niah", 700, seed)
        n = 1 + int(np.random.default_rng(seed).integers(4))
        ref = niah_example(700, num_needles=n, seed=seed, value_digits=4)
        np.testing.assert_array_equal(ex.prompt, ref.prompt)
        assert ex.answer == ref.answer and len(ex.answer) == 4
        counts.add(len(ex.needle_offsets))
    assert counts == {1, 2, 3, 4}
    for seed in range(3):
        ex = example("mrcr", 700, seed)
        ref = mrcr_example(700, seed=seed)
        np.testing.assert_array_equal(ex.prompt, ref.prompt)
        assert ex.answer == ref.answer and len(ex.prompt) == 700
    with pytest.raises(ValueError, match="unknown task"):
        example("ruler", 700, 0)


def test_all_tasks_any_length_in_range():
    for task, length in itertools.product(TASKS, (410, 999, 2048)):
        ex = example(task, length, seed=length)
        assert len(ex.prompt) == length and ex.answer
