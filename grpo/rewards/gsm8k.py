"""GSM8K answer extraction and rule-based rewards (accuracy, format).

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every reference solution with a
line "#### <answer>". A completion's answer is, in order of preference:
    1. the first number after the last "####" marker that has a number after it;
    2. else the last number inside the last \\boxed{...} (nested braces handled);
    3. else the last number anywhere in the text.
Numbers are normalised to a canonical string: thousands commas, "$", "\\$", "%", units and trailing "." dropped;
"18.00" → "18", "+5" → "5", "−3" (Unicode minus) → "-3", ".5" → "0.5"; fractions stay fractions ("1/2", also from
\\frac{1}{2}) and are compared by value. Everything here is pure and deterministic.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = ["accuracy_reward", "extract_answer", "format_reward", "normalize_number", "parse_reference"]

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# A number not glued to a preceding word, digit or dot; optional sign; optional "/denominator".
_NUMBER_RE = re.compile(rf"(?<![\w.])([+-]?(?:{_NUM}))(?:/((?:{_NUM})))?(?![\d])")
_FORMAT_RE = re.compile(rf"####\s*(?:\\?\$\s*)?[+-]?(?:{_NUM})(?:/(?:{_NUM}))?\s*\.?\s*$")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_MARKER = "####"


def _clean_text(text: str) -> str:
    """Undo LaTeX and typography that hide numbers: \\frac{a}{b} → a/b, \\text{x} → x, \\$ → $, {,} → ","."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\$", "$").replace("\\%", "%")
    text = _TEXT_RE.sub(r" \1 ", text)
    text = _FRAC_RE.sub(r"\1/\2", text)
    return _FRAC_SHORT_RE.sub(r"\1/\2", text)


def _canonical_decimal(s: str) -> str | None:
    try:
        d = Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def normalize_number(numerator: str, denominator: str | None = None) -> str | None:
    """Canonical string of a number matched by the extraction regex (see module doc); None if it does not parse."""
    num = _canonical_decimal(numerator)
    if num is None:
        return None
    if denominator is None:
        return num
    den = _canonical_decimal(denominator)
    return None if den is None else f"{num}/{den}"


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER_RE.finditer(text):
        value = normalize_number(m.group(1), m.group(2))
        if value is not None:
            out.append(value)
    return out


def _last_boxed_content(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, with nested braces; None if absent or unbalanced."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a completion as a canonical string, or None if it has no number.

    Args:
        text: model completion (EOS already stripped).

    Returns:
        e.g. "1000", "-3", "0.5", "1/2"; None when no rule of the module doc finds a number.
    """
    text = _clean_text(text)
    parts = text.split(_MARKER)
    for tail in reversed(parts[1:]):
        numbers = _numbers(tail)
        if numbers:
            return numbers[0]
    boxed = _last_boxed_content(text)
    if boxed is not None:
        numbers = _numbers(boxed)
        if numbers:
            return numbers[-1]
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def parse_reference(answer_field: str) -> str:
    """Canonical reference answer from a GSM8K `answer` field ("... #### 72") or a bare number ("72", "1,000").

    Raises:
        ValueError: no number after the last "####" (or in the bare string).
    """
    tail = answer_field.rsplit(_MARKER, 1)[-1]
    numbers = _numbers(_clean_text(tail))
    if not numbers:
        raise ValueError(f"GSM8K reference has no number after the last '####': {answer_field[-80:]!r}")
    return numbers[0]


def _to_float(value: str) -> float | None:
    try:
        if "/" in value:
            num, den = value.split("/")
            return float(num) / float(den) if float(den) != 0.0 else None
        return float(value)
    except ValueError:
        return None


def _numbers_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    fa, fb = _to_float(a), _to_float(b)
    if fa is None or fb is None:
        return False
    return math.isclose(fa, fb, rel_tol=1e-6, abs_tol=0.0)


def accuracy_reward(completion: str, reference_answer: str) -> float:
    """1.0 if the completion's extracted answer equals the reference numerically (relative tolerance 1e-6), else 0.0.

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

    Allowed around the number: "$" before it, a "." and whitespace after it; nothing else (no units).
    """
    lines = [line for line in completion.splitlines() if line.strip()]
    if not lines:
        return 0.0
    return 1.0 if _FORMAT_RE.search(lines[-1]) else 0.0
