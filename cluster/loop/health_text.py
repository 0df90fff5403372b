"""What the health detectors look for in one completion: a repetition loop at its end, garbled characters in its text.

Both are pure functions of one completion, cheap enough to run on every sampled completion of every step
(``bench/bench_goodput_overhead.py`` times them on the demo's batch).

- :func:`loop_tokens`: a completion ends in a repetition loop when its last tokens are one block of p tokens
  (1 <= p <= :data:`MAX_PERIOD`) repeated: ``ids[i] == ids[i + p]`` for every i of a suffix. The loop covers that
  suffix plus the first block; it counts when the block repeats at least ``min_repeats`` times and covers at least
  ``min_tokens`` tokens. Token ids, not text: a loop of one token (a newline, a space) is as visible as a loop of
  a sentence, and nothing depends on how the tokenizer splits words.
- :func:`garbled_chars`: characters no healthy decoded text holds — U+FFFD (the decoder's replacement for a broken
  UTF-8 byte sequence: a byte-level model sampling bytes that never form a character), control characters other
  than tab, line feed and carriage return (Unicode category Cc), private-use (Co), unassigned (Cn) and surrogate (Cs)
  code points.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

__all__ = ["MAX_PERIOD", "garbled_chars", "is_garbled", "is_looping", "loop_tokens"]

#: Longest repeated block the loop check looks for, tokens.
MAX_PERIOD = 64
_ALLOWED_CONTROLS = frozenset("\t\n\r")
_GARBLED_CATEGORIES = frozenset(("Cc", "Co", "Cn", "Cs"))


def loop_tokens(ids: Sequence[int], min_repeats: int) -> int:
    """Tokens covered by the longest repetition loop ``ids`` ends in (0: none).

    For each period p the periodic suffix is found by walking back from the end while ``ids[i] == ids[i + p]``; the
    loop covers that run plus one block (p tokens) and must repeat its block at least ``min_repeats`` times
    (covered >= min_repeats · p). Cost: O(MAX_PERIOD · covered) in the worst case, O(MAX_PERIOD) for a completion
    that ends in no loop (the walk stops at the first mismatch).

    Args:
        ids: the completion's token ids (the sampled response). min_repeats: >= 2.
    """
    n = len(ids)
    best = 0
    for p in range(1, min(MAX_PERIOD, n // min_repeats) + 1):
        i = n - p - 1
        while i >= 0 and ids[i] == ids[i + p]:
            i -= 1
        covered = n - 1 - i  # tokens n-1-i .. n-1: the run (n - p - 1 - i tokens) and its first block (p)
        if covered >= min_repeats * p:
            best = max(best, covered)
    return best


def is_looping(ids: Sequence[int], min_repeats: int, min_tokens: int) -> bool:
    """``ids`` ends in a repetition loop of at least ``min_repeats`` repeats covering at least ``min_tokens``
    tokens (:func:`loop_tokens`)."""
    return len(ids) >= min_tokens and loop_tokens(ids, min_repeats) >= min_tokens


def garbled_chars(text: str) -> int:
    """Characters of ``text`` that no healthy decoded text holds (module docstring)."""
    count = 0
    for ch in text:
        if ch.isprintable() or ch in _ALLOWED_CONTROLS:
            if ch == "\ufffd":
                count += 1
            continue
        if unicodedata.category(ch) in _GARBLED_CATEGORIES:
            count += 1
    return count


def is_garbled(text: str, min_chars: int) -> bool:
    """``text`` holds at least ``min_chars`` garbled characters (:func:`garbled_chars`)."""
    return garbled_chars(text) >= min_chars
