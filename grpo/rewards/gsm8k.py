"""GSM8K answer extraction and rule-based rewards (accuracy, format).

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every reference solution with a
line "#### <answer>". A completion's answer is, in order of preference:
    1. the first number after the last "####" marker that has a number after it;
    2. else the last number inside the last \\boxed{...} (nested braces handled);
    3. else the last number anywhere in the text.
Numbers are normalised to a canonical string: thousands commas, "$", "\\$", "%", units and trailing "." dropped;
"18.00" → "18", "+5" → "5", "−3" (Unicode minus) → "-3", ".5" → "0.5"; fractions stay fractions ("1/2", also from
\\frac{1}{2}) and are compared by value. Everything here is pure and deterministic.

What is not a number:
    - a digit run with more than ``MAX_DIGITS`` digits before or after the decimal point (such a token is skipped
      as a whole, never truncated);
    - scientific notation: "1e400", "2.5e3", "1e+5" are skipped as a whole (neither mantissa nor exponent is taken),
      since GSM8K answers are plain numbers and a mantissa alone would be a wrong answer;
    - a three-digit run right after "<digit>," (a thousands group that did not fit its number, as in "1,000e5").

Numbers are compared exactly (fractions), so big numbers neither overflow nor compare equal by accident.

Cost: extraction and both rewards are linear in the completion length (no quadratic regex backtracking, one pass
for \\boxed{} brace matching); a 1 MB completion is scored in well under a second. ``accuracy_reward`` and
``format_reward`` never raise for a str completion.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["MAX_DIGITS", "accuracy_reward", "extract_answer", "format_reward", "normalize_number", "parse_reference"]

MAX_DIGITS = 1000
"""Most digits a number may have before, and again after, its decimal point; longer runs are not numbers. Keeps
every conversion far below Python's 4300-digit int/str limit (a decimal's two parts together: 2000 digits)."""

_REL_TOL = Fraction(1, 10**6)
# Thousands groups are exactly three digits ("1,0000" is "1" then "0000").
_NUM = r"(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+"
# A number: optional sign, optional "/denominator". It does not start glued to a preceding word, digit or dot, in
# the exponent of "1e+5", or at a later thousands group of "1,000,000". The atomic group forbids backtracking to a
# shorter prefix, so "2.5e3" does not yield "2"; the final lookahead rejects a following digit or exponent. The
# leading lookahead only lets the engine skip non-number characters fast.
_NUMBER_RE = re.compile(
    rf"(?=[\d.+-])(?<![\w.])(?<!\d[eE][+-])(?!(?<=\d,)\d{{3}}(?!\d))"
    rf"(?>([+-]?(?:{_NUM}))(?:/({_NUM}))?)(?!\d|[eE][+-]?\d)")
# What must follow the last "####" of a well-formatted last line, once a trailing "." and whitespace are removed.
_FORMAT_TAIL_RE = re.compile(rf"\s*+(?:\\?\$\s*+)?([+-]?(?:{_NUM}))(?:/({_NUM}))?")
_DECIMAL_RE = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
_BRACE_RE = re.compile(r"[{}]")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*+\{([^{}]*+)\}\s*+\{([^{}]*+)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*+(\d)\s*+(\d)")
# A sign written before a currency sign ("-$5", "+$5"): the sign belongs to the number.
_SIGNED_CURRENCY_RE = re.compile(r"(?<![\w.])([+-])\$[ \t]*+(?=\.?\d)")
_INT = r"(?>\d{1,3}(?:,\d{3}(?!\d))+|\d+)"
# A mixed number "2 1/2" (whole, spaces or tabs, integer fraction). Possessive/atomic parts and the lookbehind (a
# match starts only at the start of a digit run) keep the scan linear.
_MIXED_RE = re.compile(rf"(?<![\w.,/])([+-]?)({_INT})[ \t]++(\d++)/(\d++)(?![\d/]|\.\d|[eE][+-]?\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*+\{([^{}]*+)\}")
_MARKER = "####"


def _clean_text(text: str) -> str:
    """Undo LaTeX and typography that hide numbers: \\frac{a}{b} → a/b, \\text{x} → x, \\$ → $, {,} → ","."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\$", "$").replace("\\%", "%")
    text = _TEXT_RE.sub(r" \1 ", text)
    text = _FRAC_RE.sub(lambda m: f"{_digit_gap(m)}{m.group(1).strip()}/{m.group(2).strip()}", text)
    text = _FRAC_SHORT_RE.sub(lambda m: f"{_digit_gap(m)}{m.group(1)}/{m.group(2)}", text)
    return _join_signs_and_mixed(text)


def _digit_gap(m: re.Match) -> str:
    """" " when a \\frac follows a digit ("2\\frac{1}{2}" is the mixed number 2 1/2, not 21/2), else ""."""
    return " " if m.start() > 0 and m.string[m.start() - 1].isdigit() else ""


def _mixed_to_fraction(m: re.Match) -> str:
    """"2 1/2" → "5/2", "-2 1/2" → "-5/2"; the text unchanged unless the fraction is proper (0 < den, num < den)
    and the result has at most MAX_DIGITS digits."""
    sign, whole, num, den = m.group(1), m.group(2).replace(",", ""), m.group(3), m.group(4)
    if max(len(whole), len(num), len(den)) > MAX_DIGITS or not int(num) < int(den):
        return m.group()
    numerator = int(whole) * int(den) + int(num)
    if len(str(numerator)) > MAX_DIGITS:
        return m.group()
    return f"{'-' if sign == '-' else ''}{numerator}/{den}"


def _join_signs_and_mixed(text: str) -> str:
    """"−$5" / "-$5" → "-5" (the sign before a currency sign is the number's) and mixed numbers → one fraction."""
    text = _SIGNED_CURRENCY_RE.sub(r"\1", text.replace("\u2212", "-"))
    return _MIXED_RE.sub(_mixed_to_fraction, text)


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
    """Canonical string of a number matched by the extraction regex (see module doc); None if it does not parse
    or has more than MAX_DIGITS digits before or after its decimal point."""
    num = _canonical_decimal(numerator)
    if num is None:
        return None
    if denominator is None:
        return num
    den = _canonical_decimal(denominator)
    return None if den is None else f"{num}/{den}"


def _first_number(text: str, pos: int = 0) -> str | None:
    """The first number (canonical) starting at or after ``pos``; None if there is none."""
    for m in _NUMBER_RE.finditer(text, pos):
        value = normalize_number(m.group(1), m.group(2))
        if value is not None:
            return value
    return None


def _last_number(text: str) -> tuple[str, int] | None:
    """(canonical value, start index) of the last number in ``text``; None if there is none.

    ``split`` keeps the scan in C (match objects for every number of a long text cost far more); positions are
    recovered from the lengths of the pieces, from the end.
    """
    pieces = _NUMBER_RE.split(text)  # [text, num, den, text, num, den, ..., text]; den None when absent
    end = len(text)
    for k in range(len(pieces) - 3, 0, -3):
        num, den, after = pieces[k], pieces[k + 1], pieces[k + 2]
        start = end - len(after) - len(num) - (0 if den is None else len(den) + 1)
        value = normalize_number(num, den)
        if value is not None:
            return value, start
        end = start
    return None


def _last_boxed_content(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} / \\fbox{...}, with nested braces; None if there is none.

    One pass over the braces with a stack (linear time, also with many unbalanced \\boxed{).
    """
    opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}
    if not opens:
        return None
    closing: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text, min(opens)):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            start = stack.pop()
            if start in opens:
                closing[start] = m.start()
    if not closing:
        return None
    start = max(closing)
    return text[start + 1:closing[start]]


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a completion as a canonical string, or None if it has no number.

    Args:
        text: model completion (EOS already stripped).

    Returns:
        e.g. "1000", "-3", "0.5", "1/2"; None when no rule of the module doc finds a number.
    """
    text = _clean_text(text)
    last = _last_number(text)
    if last is None:
        return None
    value, start = last
    first_marker = text.find(_MARKER)
    if 0 <= first_marker and first_marker + len(_MARKER) <= start:
        # The last number follows a marker, so the last marker with a number after it is the last one before it.
        return _first_number(text, text.rfind(_MARKER, 0, start) + len(_MARKER))
    boxed = _last_boxed_content(text)
    if boxed is not None:
        in_box = _last_number(boxed)
        if in_box is not None:
            return in_box[0]
    return value


def parse_reference(answer_field: str) -> str:
    """Canonical reference answer from a GSM8K `answer` field ("... #### 72") or a bare number ("72", "1,000").

    Raises:
        ValueError: no number after the last "####" (or in the bare string).
    """
    tail = answer_field.rsplit(_MARKER, 1)[-1]
    number = _first_number(_clean_text(tail))
    if number is None:
        raise ValueError(f"GSM8K reference has no number after the last '####': {answer_field[-80:]!r}")
    return number


def _to_fraction(value: str) -> Fraction | None:
    """Exact value of a canonical number ("-0.5", "1/2"); None for a zero denominator."""
    num, _, den = value.partition("/")
    if not den:
        return Fraction(num)
    denominator = Fraction(den)
    return Fraction(num) / denominator if denominator != 0 else None


def _numbers_equal(a: str, b: str) -> bool:
    """Equal within a relative tolerance of 1e-6 (like math.isclose), computed exactly; x/0 equals nothing."""
    fa, fb = _to_fraction(a), _to_fraction(b)
    if fa is None or fb is None:
        return False
    return abs(fa - fb) <= _REL_TOL * max(abs(fa), abs(fb))


def accuracy_reward(completion: str, reference_answer: str) -> float:
    """1.0 if the completion's extracted answer equals the reference numerically, else 0.0.

    Equal means |a - b| <= 1e-6 · max(|a|, |b|), computed exactly with fractions (no float overflow: two numbers
    of 400 digits that differ are not equal). Never raises for a str completion.

    Args:
        completion: model completion.
        reference_answer: full GSM8K answer field (with "#### N") or a bare number.

    Raises:
        ValueError: the reference has no number (`parse_reference`).
    """
    reference = parse_reference(reference_answer)
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if _numbers_equal(predicted, reference) else 0.0


def format_reward(completion: str) -> float:
    """1.0 if the last non-empty line ends with "#### <number>", else 0.0.

    Allowed around the number: "$" before it, a "." and whitespace after it; nothing else (no units). The number
    must be one that extraction accepts (at most MAX_DIGITS digits per part). Linear time; never raises for a str.
    """
    stripped = completion.rstrip()
    if not stripped:
        return 0.0
    last_line = stripped.splitlines()[-1]
    _, marker, tail = last_line.rpartition(_MARKER)
    if not marker:
        return 0.0
    tail = _join_signs_and_mixed(tail.replace("\\$", "$")).rstrip()
    if tail.endswith("."):
        tail = tail[:-1].rstrip()
    m = _FORMAT_TAIL_RE.fullmatch(tail)
    return 1.0 if m is not None and normalize_number(m.group(1), m.group(2)) is not None else 0.0
