"""A fast token-count estimate for text the shell has not tokenized: no vocabulary, one regex.

The text is cut into segments (runs of CJK ideographs, Latin words with or without a leading
space, digit groups, newlines, indentation, punctuation runs) and each kind costs a fixed number
of tokens. The weights were fitted by benchmarks/fit_estimator.py (non-negative least squares on
relative error against the DeepSeek-V4 tokenizer) on text that is not the test corpus: this
repository's code and docs, benchmarks/data/estimator_train_zh.txt and Python standard-library
docstrings. tests/unit/core/test_policy_parts.py measures the error on the held-out corpus in
tests/data/lengths/ (English, Chinese, code, mixed).

Invariant: estimate_tokens(text) >= 1, and it grows with the text (every weight is >= 0).
"""

from __future__ import annotations

import math
import re

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_PUNCT = "\u3000-\u303f\uff00-\uffef"
_SEGMENT = re.compile(
    rf"(?P<cjk>[{_CJK}]+)"
    rf"|(?P<cjk_punct>[{_CJK_PUNCT}])"
    r"|(?P<word> ?[A-Za-z]+)"
    r"|(?P<digits>[0-9]+)"
    r"|(?P<newlines>\n+)"
    r"|(?P<indent>[ \t]{2,})"
    r"|(?P<space>[ \t])"
    rf"|(?P<punct>[^\sA-Za-z0-9{_CJK}{_CJK_PUNCT}]+)"
)

# Tokens per segment kind (fitted by benchmarks/fit_estimator.py; see the module docstring).
WEIGHTS: dict[str, float] = {
    "cjk_run": 1.02,  # each run of ideographs
    "cjk_char": 0.54,  # each ideograph in it
    "cjk_punct": 0.00,  # full-width punctuation merges with its neighbours
    "spaced_word": 1.08,  # " word": one token for most words
    "bare_word": 0.82,  # a word glued to punctuation (identifiers: snake_case pieces)
    "long_word_char": 0.29,  # each letter past the ninth
    "digit_group": 1.49,  # each group of up to three digits
    "newlines": 0.83,  # each run of newlines
    "indent": 0.40,  # each run of two or more spaces or tabs
    "punct_run": 1.05,  # each run of punctuation
}
LONG_WORD_AFTER = 9


def features(text: str) -> dict[str, float]:
    """How many segments of each kind `text` holds (the estimate's inputs)."""
    counts = dict.fromkeys(WEIGHTS, 0.0)
    for match in _SEGMENT.finditer(text):
        kind, segment = match.lastgroup, match.group()
        if kind == "cjk":
            counts["cjk_run"] += 1
            counts["cjk_char"] += len(segment)
        elif kind == "word":
            spaced = segment.startswith(" ")
            counts["spaced_word" if spaced else "bare_word"] += 1
            counts["long_word_char"] += max(0, len(segment) - spaced - LONG_WORD_AFTER)
        elif kind == "digits":
            counts["digit_group"] += math.ceil(len(segment) / 3)
        elif kind in ("newlines", "indent", "cjk_punct"):
            counts[kind] += 1
        elif kind == "punct":
            counts["punct_run"] += 1
    return counts


def estimate_tokens(text: str) -> int:
    """Approximate number of tokens in `text` (at least 1)."""
    counts = features(text)
    return max(1, round(sum(WEIGHTS[kind] * n for kind, n in counts.items())))
