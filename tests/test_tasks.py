"""Task generators place needles where they say; the scorer scores exactly."""

import numpy as np
import pytest

from lsparse_jax.tasks import niah_example, score_exact, tokenizer


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
