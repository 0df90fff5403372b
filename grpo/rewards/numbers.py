"""Reading numbers from normalised text (:func:`grpo.rewards.answer_text.clean_text`) and comparing them exactly.

A number is an optional sign, digits with optional thousands commas ("1,234", groups of exactly three digits) and an
optional decimal part, or a leading-dot decimal (".5"), optionally followed by "/denominator". Its canonical string
drops the commas, leading zeros, trailing decimal zeros, a "+" and the sign of zero: "18.00" → "18", "+5" → "5",
".5" → "0.5", "-0" → "0"; fractions stay fractions ("1/2") and are compared by value.

Kinds (members enumerated by ``tests/unit/test_rewards_kinds.py``):

- **Mixed numbers**: a whole number (sign and thousands commas allowed), one or more spaces or tabs, then a proper
  fraction (0 <= numerator < denominator, both plain integers) are one value: "2 1/2" → "5/2", "-2 1/2" → "-5/2"
  (the sign applies to the whole), "1,000 1/4" → "4001/4". Whatever wrote the fraction (a slash, a LaTeX macro, a
  Unicode vulgar fraction: :mod:`grpo.rewards.answer_text`) and whichever way the number is found (the first after a
  marker or the last in a text). Not mixed numbers: an improper fraction ("2 3/2" is 2 then 3/2), a zero denominator
  ("2 1/0"), a decimal part anywhere ("2.5 1/2", "2 1/2.5"), a fraction followed by another "/" ("2 1/2/3"), a
  whole number glued to a word or dot before it, and numbers joined by anything but spaces ("2-1/2" is 2 then 1/2).
- **What is not a number**: a digit run with more than :data:`MAX_DIGITS` digits before or after the decimal point
  (skipped as a whole, never truncated); scientific notation ("1e400", "2.5e3", "1e+5": skipped as a whole, neither
  mantissa nor exponent is taken); a three-digit run right after "<digit>," (a thousands group that did not fit its
  number, as in "1,000e5"); digits glued to a preceding letter, digit, "_" or dot ("abc123", "x2").

Equality (:func:`numbers_equal`): |a − b| <= 1e-6 · max(|a|, |b|), computed exactly with fractions, so big numbers
neither overflow nor compare equal by accident; x/0 equals nothing. Every scan here is linear in the text length.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["MAX_DIGITS", "NUMBER_RE", "NUMBER_BODY", "first_number", "last_number", "mixed_value",
           "normalize_number", "numbers_and_gaps", "numbers_equal"]

MAX_DIGITS = 1000
"""Most digits a number may have before, and again after, its decimal point; longer runs are not numbers. Keeps
every conversion far below Python's 4300-digit int/str limit (a decimal's two parts together: 2000 digits)."""

_REL_TOL = Fraction(1, 10**6)
#: The digits of a number without sign or denominator. Thousands groups are exactly three digits ("1,0000" is "1"
#: then "0000").
NUMBER_BODY = r"(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+"
# A number: optional sign, optional "/denominator". It does not start glued to a preceding word, digit or dot, in
# the exponent of "1e+5", or at a later thousands group of "1,000,000". The atomic group forbids backtracking to a
# shorter prefix, so "2.5e3" does not yield "2"; the final lookahead rejects a following digit or exponent. The
# leading lookahead only lets the engine skip non-number characters fast.
NUMBER_RE = re.compile(
    rf"(?=[\d.+-])(?<![\w.])(?<!\d[eE][+-])(?!(?<=\d,)\d{{3}}(?!\d))"
    rf"(?>([+-]?(?:{NUMBER_BODY}))(?:/({NUMBER_BODY}))?)(?!\d|[eE][+-]?\d)")
_DECIMAL_RE = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")
# The fraction of a mixed number "2 1/2", right after its whole part; the lookahead rejects "2 1/2.5", "2 1/2/3".
_MIXED_TAIL_RE = re.compile(r"[ \t]++(\d++)/(\d++)(?![\d/]|\.\d|[eE][+-]?\d)")
_WHOLE_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DIGITS_AND_COMMAS = frozenset("0123456789,")


def mixed_value(whole: str, numerator: str, denominator: str) -> str | None:
    """The mixed number whole + numerator/denominator as one canonical fraction: ("2", "1", "2") → "5/2",
    ("-2", "1", "2") → "-5/2". None unless ``whole`` is a canonical integer, 0 <= numerator < denominator, and every
    part has at most MAX_DIGITS digits (an improper "2 3/2" is two numbers, not a mixed number)."""
    if "." in whole or "/" in whole or max(len(numerator), len(denominator)) > MAX_DIGITS:
        return None
    num, den = int(numerator), int(denominator)
    if not num < den:
        return None
    value = abs(int(whole)) * den + num
    digits = str(value)
    if len(digits) > MAX_DIGITS:
        return None
    return f"{'-' if whole.startswith('-') else ''}{digits}/{den}"


def _with_mixed_tail(text: str, value: str, end: int) -> str:
    """``value`` (a number ending at ``end``) joined with a proper fraction right after it ("2" + " 1/2" → "5/2")."""
    m = _MIXED_TAIL_RE.match(text, end)
    mixed = None if m is None else mixed_value(value, m.group(1), m.group(2))
    return value if mixed is None else mixed


def _with_whole_before(text: str, value: str, start: int) -> tuple[str, int]:
    """(value, start) of a fraction starting at ``start``, joined with a whole number right before it ("2 " + "1/2"
    → "5/2", start moved to the whole part). One backward scan over the spaces and digits before ``start``."""
    num, slash, den = value.partition("/")
    if not slash or "." in num or "." in den or num.startswith("-"):
        return value, start
    j = start
    while j > 0 and text[j - 1] in " \t":
        j -= 1
    k = j
    while k > 0 and text[k - 1] in _DIGITS_AND_COMMAS:
        k -= 1
    if k > 1 and text[k - 1] in "+-" and not (text[k - 2].isalnum() or text[k - 2] in "_."):
        k -= 1
    elif k == 1 and text[0] in "+-":
        k = 0
    if j == start or k == j or (k > 0 and (text[k - 1].isalnum() or text[k - 1] in "_.,/")):
        return value, start
    if _WHOLE_RE.fullmatch(text, k, j) is None:
        return value, start
    whole = normalize_number(text[k:j])
    mixed = None if whole is None else mixed_value(whole, num, den)
    return (value, start) if mixed is None else (mixed, k)


def _canonical_decimal(s: str) -> str | None:
    """"-1,000.50" → "-1000.5"; None unless s is a plain decimal with at most MAX_DIGITS digits per part."""
    m = _DECIMAL_RE.fullmatch(s.replace(",", ""))
    if m is None or not (m.group(2) or m.group(3)):
        return None
    sign, whole, frac = m.group(1), m.group(2), m.group(3) or ""
    if len(whole) > MAX_DIGITS or len(frac) > MAX_DIGITS:
        return None
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    body = f"{whole}.{frac}" if frac else whole
    return f"-{body}" if sign == "-" and body != "0" else body


def normalize_number(numerator: str, denominator: str | None = None) -> str | None:
    """Canonical string of a number matched by :data:`NUMBER_RE` (module doc); None if it does not parse or has more
    than MAX_DIGITS digits before or after its decimal point."""
    num = _canonical_decimal(numerator)
    if num is None:
        return None
    if denominator is None:
        return num
    den = _canonical_decimal(denominator)
    return None if den is None else f"{num}/{den}"


def first_number(text: str, pos: int = 0) -> str | None:
    """The first number (canonical; a mixed number as one) starting at or after ``pos``; None if there is none."""
    for m in NUMBER_RE.finditer(text, pos):
        value = normalize_number(m.group(1), m.group(2))
        if value is not None:
            return value if m.group(2) is not None else _with_mixed_tail(text, value, m.end())
    return None


def last_number(text: str) -> tuple[str, int] | None:
    """(canonical value, start index) of the last number in ``text`` (a mixed number as one, starting at its whole
    part); None if there is none.

    ``split`` keeps the scan in C (match objects for every number of a long text cost far more); positions are
    recovered from the lengths of the pieces, from the end.
    """
    pieces = NUMBER_RE.split(text)  # [text, num, den, text, num, den, ..., text]; den None when absent
    end = len(text)
    for k in range(len(pieces) - 3, 0, -3):
        num, den, after = pieces[k], pieces[k + 1], pieces[k + 2]
        start = end - len(after) - len(num) - (0 if den is None else len(den) + 1)
        value = normalize_number(num, den)
        if value is not None:
            return _with_whole_before(text, value, start)
        end = start
    return None


def _to_fraction(value: str) -> Fraction | None:
    """Exact value of a canonical number ("-0.5", "1/2"); None for a zero denominator."""
    num, _, den = value.partition("/")
    if not den:
        return Fraction(num)
    denominator = Fraction(den)
    return Fraction(num) / denominator if denominator != 0 else None


def numbers_equal(a: str, b: str) -> bool:
    """Two canonical numbers equal within a relative tolerance of 1e-6 (like math.isclose), computed exactly;
    x/0 equals nothing."""
    fa, fb = _to_fraction(a), _to_fraction(b)
    if fa is None or fb is None:
        return False
    return abs(fa - fb) <= _REL_TOL * max(abs(fa), abs(fb))


def numbers_and_gaps(text: str) -> tuple[list[str], list[str]]:
    """(numbers, gaps) of a normalised text (:func:`grpo.rewards.answer_text.clean_text`): its numbers in order,
    canonical (a mixed number "2 1/2" as one; numbers that do not parse are part of a gap), and ``gaps[i]``, the text
    between number i-1 and number i (``gaps[0]``: before the first; ``gaps[-1]``, one more than the numbers: after
    the last).

    One C-level split; each distinct number is normalised once (a 1 MB run of one number costs one parse).
    """
    pieces = NUMBER_RE.split(text)  # [text, num, den, text, num, den, ..., text]; den None when absent
    cache: dict[tuple[str, str | None], str | None] = {}
    vals: list[str] = []
    gaps: list[str] = []
    gap = pieces[0]
    for k in range(1, len(pieces) - 1, 3):
        raw = (pieces[k], pieces[k + 1])
        if raw not in cache:
            cache[raw] = normalize_number(*raw)
        value = cache[raw]
        if value is None:
            gap += pieces[k] + ("" if raw[1] is None else "/" + raw[1]) + pieces[k + 2]
            continue
        mixed = _mixed_across(vals, gap, raw)
        if mixed is not None:
            vals[-1] = mixed
        else:
            vals.append(value)
            gaps.append(gap)
        gap = pieces[k + 2]
    return vals, [*gaps, gap]


def _mixed_across(vals: list[str], gap: str, raw: tuple[str, str | None]) -> str | None:
    """The mixed number "whole numerator/denominator" when a proper fraction ``raw`` (numerator, denominator as
    written) follows the integer ``vals[-1]`` across a gap of spaces or tabs only ("2 1/2"); else None."""
    if not vals or raw[1] is None or not gap or gap.strip(" \t") or "/" in vals[-1] or "." in vals[-1]:
        return None
    if not (raw[0].isdigit() and raw[1].isdigit()):
        return None
    return mixed_value(vals[-1], raw[0], raw[1])
