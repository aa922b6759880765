"""Answer scorers for the synthetic tasks (NIAH, MRCR)."""

from __future__ import annotations

import difflib


def score_exact(generated: str, answer: str) -> float:
    """1.0 when the generated text starts with the answer, else 0.0."""
    return float(generated.startswith(answer))


def score_similarity(generated: str, answer: str) -> float:
    """MRCR-style graded score in [0, 1].

    The generated text is first truncated to the answer's length (so text generated past the
    answer is not penalised), then compared with ``difflib.SequenceMatcher(None, answer, g,
    autojunk=False).ratio()``, i.e. ``2 * M / (len(answer) + len(g))``.

    Notation:
      g: ``generated[:len(answer)]``
      M: total size of the matching blocks SequenceMatcher finds (longest common contiguous
         block first, then recursively left and right of it); ``answer`` is sequence a, ``g``
         is sequence b (the ratio can depend on the order, so it is fixed here).

    Both empty (answer "" ) gives 1.0. Example: answer "abcdefgh\\n", generated
    "abcdxfgh\\n..." gives g = "abcdxfgh\\n", M = 8, score 16 / 18 = 8 / 9.
    """
    g = generated[:len(answer)]
    return difflib.SequenceMatcher(None, answer, g, autojunk=False).ratio()
