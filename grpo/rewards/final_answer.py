"""What a completion puts forward as its final answer, and whether it commits to one: the rule every verifier that reads
an answer applies before it compares anything with the reference (``accuracy`` and ``format``,
:mod:`grpo.rewards.gsm8k`; ``reasoning_gym``; ``math``; held-out evaluation calls the same functions). STYLE rule 18:
a score of 1 needs one committed final answer equivalent to the reference; a hedge — the right value put forward with
a wrong one — is wrong. Pure and deterministic; linear in the completion length.

**The answer part.** Text up to the last ``</think>`` is deliberation (a reasoning model's thinking) and puts nothing
forward; the rest is the answer part (the whole completion when it has no ``</think>``).

**Final-answer statements** (:func:`statements`), in the answer part:

- S1 each ``####`` marker: the rest of its line (to the next line break or ``####``);
- S2 each ``\\boxed{...}`` / ``\\fbox{...}``: its content (balanced braces);
- S3 each ``<answer>...</answer>``: its content;
- S4 each answer phrase — "the/my/our [final/correct/right] answer", "final answer", or a line that starts with
  "[Final] Answer", followed by "is" (not "is not"), ":" or "=" (any case): the rest of its sentence (to a line break,
  or a ".", "!" or "?" before whitespace), no further than the next statement or answer phrase. A phrase in a
  condition or a check ("if the answer is 4", "to verify that the answer is right": one of :data:`CONDITION_WORDS`
  at most two words before it) is none.

A statement inside another one (a box on a ``####`` line, a phrase inside a box) is part of that one. Each verifier
reads a statement its own way and ignores one that names nothing (no number; empty; nothing math-verify parses).
Without any statement that names something, the final answer is *unmarked* (S5): the completion's last value (its
last number; for ``math``, what math-verify reads in the last sentence holding a digit or a ``$``), which must lie in
the answer part. Numbers anywhere else — the working before the answer, the operands of "12 - 9 = 3" — are not
final answers, so they are never alternatives.

**Alternatives** (:func:`offers_alternatives`). Values are numbers as :mod:`grpo.rewards.numbers` reads them after
:func:`grpo.rewards.answer_text.clean_text` ("1,000", "2 1/2", "3/4", ``\\frac{3}{4}`` are one value each), and two
differ when they are unequal in value ("12" and "12.0" are one). Two values that differ and are adjacent in a
statement (no value between them) are alternatives when the text between them (the gap, with LaTeX spacing,
``\\text{}``, ``$``, braces and "x =" assignments removed) is

- A1 a hedge: it holds one of :data:`HEDGE_WORDS` (or, either, maybe, perhaps, possibly, between, ...) or a logical or
  (``\\lor``, ``\\vee``, "∨"): "3 or 4", "3 (or maybe 5)", "3, possibly 5";
- A2 a range or a choice, next to the answer: "-", "/" (with spaces: "3/4" is one fraction), "to", "through", "..."
  ("#### 3-5", "#### 3 / 4", "3 to 5"; "between 3 and 5" is A1 and A3) — not between two other values ("12 - 9 = 3"
  names 3), and not in an expression read by math-verify (``arithmetic=True``), where "5-2" is a subtraction;
- A3 a list: nothing but ",", ";", "&" or "and", or spacing alone ("3, 4", "\\{3, 4\\}", "3 \\text{ and } 4",
  "x = 3, x = 4", "3 4"; not braces alone, which are LaTeX structure: ``\\binom{5}{2}``);

or the second stands alone in parentheses ("3 (4)", "3 (4?)"); and A4, a statement with a value and a both-signs mark
(±, ∓, ``\\pm``, ``\\mp``, "+/-") offers two values. In S5 only the last value is judged: against the one before it
in its sentence, and for a hedge word before it in its own sentence ("either 12, 13 or 14" and "It is 3. Or is it
4?" are hedges; "The sum of 12 and 19 is 31" is not).

**Commitment.** A completion commits to its final answer when

- C1 it has one: a statement that names something, else (S5) a last value in its answer part;
- C2 no statement offers alternatives (S5: the last value is not offered as one, as just said);
- C3 every statement names the same answer, compared by the verifier (numbers by value, math-verify, the task's
  answer text): a restated answer is one answer, a different one — another ``\\boxed{}``, a second ``####`` ("wait,
  no" included), "\\boxed{3} ... The final answer is 4" — is a hedge;
- C4 in the rest of the last statement's sentence and in the next sentence, no hedge word is followed by values the
  last of which (in that sentence) is other than the answer (:func:`hedged_after`: "\\boxed{3}. Or maybe 5.",
  "#### 3\\nOr 4." are hedges; "... or equivalently add -1 to 4, to get 3." is not).

Only a verifier whose reference is itself several values (``math``: a set, a tuple, an interval, a ± answer) lets
A1-A4 stand: there the list is the answer and is judged against the reference; C1, C3 and C4 hold for it too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal, NamedTuple

from grpo.rewards.answer_text import clean_text
from grpo.rewards.numbers import NUMBER_RE, first_number, last_number, normalize_number, numbers_and_gaps, numbers_equal

__all__ = ["CONDITION_WORDS", "HEDGE_WORDS", "Statement", "answer_start", "committed_number", "commits_to_number",
           "hedged_after", "last_value_hedged", "number_named", "offers_alternatives", "sentence_around", "statements",
           "values"]

#: Words that, between two different values, offer one in place of the other (rule A1).
HEDGE_WORDS = ("or", "either", "nor", "maybe", "perhaps", "possibly", "possible", "probably", "could", "might",
               "alternatively", "otherwise", "between")
#: Words that, at most two words before an answer phrase, make it a condition or a check, not a statement (rule S4).
CONDITION_WORDS = ("if", "whether", "suppose", "supposing", "assume", "assuming", "check", "verify", "unless")

THINK_END = "</think>"
_MARKER_LINE_RE = re.compile(r"####((?:[^\n#]|#(?!###))*)")
_HEDGE_RE = re.compile(rf"(?i)\b(?:{'|'.join(HEDGE_WORDS)})\b|\\(?:lor|vee)(?![A-Za-z])|\u2228")
_BOTH_SIGNS_RE = re.compile(r"[\u00b1\u2213]|\\(?:pm|mp)(?![A-Za-z])|\+\s*/\s*-")
_CONDITION_RE = re.compile(rf"(?i)\b(?:{'|'.join(CONDITION_WORDS)})\b(?:[ \t]+\w+){{0,2}}[ \t]*$")
# An answer phrase is found from the word "answer" (a fast literal scan): what must come before it (a determiner or
# "final", or the start of a line) and after it ("is", ":" or "=").
_ANSWER_WORD_RE = re.compile(r"(?i)answer")
_PHRASE_BEFORE_RE = re.compile(r"(?i)(?:\b(?:the|my|our)[ \t]+(?:(?:final|correct|right)[ \t]+)?|\bfinal[ \t]+"
                               r"|\n[ \t*#>_-]*)$")
_PHRASE_AFTER_RE = re.compile(r"(?i)[ \t*]*(?:is(?!n'?t\b)\b(?![ \t]+not\b)|:|=)[ \t*:]*")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
_BRACE_RE = re.compile(r"[{}]")
_TAG_RE = re.compile(r"<(/?)answer>")
_SENTENCE_END_RE = re.compile(r"\n|[.!?](?=\s|$)")
# What a gap between two values may hold besides its connective: spacing, \text-like wrappers, math delimiters,
# braces, Markdown bold ("**"; a single "*" is a product), and an assignment "x =" / "x_2 =" before the second value.
_GAP_NOISE_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mbox|quad|qquad|left|right|displaystyle)(?![A-Za-z])|\\[{}]|[\s{}$]|\*\*"
    r"|\b[A-Za-z](?:_\w+)?\s*=")
_LIST_GAP_RE = re.compile(r"(?:[,;&]|\\&|and)+")
_RANGE_GAP_RE = re.compile(r"[-/]|to|through|\.\.\.?|\u2026")
_WORD_RANGE_RE = re.compile(r"to|through|\.\.\.?|\u2026")


class Statement(NamedTuple):
    """One final-answer statement (module doc, S1-S4).

    Attributes:
        kind: ``marker`` (S1), ``boxed`` (S2), ``tag`` (S3) or ``phrase`` (S4).
        text: what it states: the marker's line, the box's or tag's content, the phrase's sentence rest.
        start, end: ``text``'s span in the completion (``completion[start:end] == text``).
    """

    kind: Literal["marker", "boxed", "tag", "phrase"]
    text: str
    start: int
    end: int


def answer_start(text: str) -> int:
    """Index where the answer part begins: right after the last ``</think>``, else 0 (module doc)."""
    end = text.rfind(THINK_END)
    return 0 if end < 0 else end + len(THINK_END)


#: A statement found but not yet cut from the text: (outer start, outer end, kind, start, end); the outer span holds
#: its marker (``####``, ``\\boxed{``, ``<answer>``), the inner one its text.
_Span = tuple[int, int, str, int, int]


def _markers(text: str, base: int) -> list[_Span]:
    """The span of every ``####`` (S1): its line runs to the next line break or ``####``; one regex pass."""
    return [(m.start(), m.end(), "marker", m.start(1), m.end(1)) for m in _MARKER_LINE_RE.finditer(text, base)]


def _boxes(text: str, base: int) -> list[_Span]:
    """The span of every balanced ``\\boxed{}``/``\\fbox{}``: one pass over the
    braces with a stack (linear also with many unbalanced openings)."""
    opens = {m.end() - 1: m.start() for m in _BOX_RE.finditer(text, base)}
    if not opens:
        return []
    out, stack = [], []
    for m in _BRACE_RE.finditer(text, min(opens)):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            brace = stack.pop()
            if brace in opens:
                out.append((opens[brace], m.end(), "boxed", brace + 1, m.start()))
    return out


def _tags(text: str, base: int) -> list[_Span]:
    """The span of every ``<answer>...</answer>``, paired as a leftmost non-greedy
    regex would pair them, in one pass."""
    out, pending = [], None
    for m in _TAG_RE.finditer(text, base):
        if not m.group(1):
            pending = m if pending is None else pending
        elif pending is not None:
            out.append((pending.start(), m.end(), "tag", pending.end(), m.start()))
            pending = None
    return out


class _SentenceEnds:
    """``next(pos)``: the index of the first sentence end (a line break, or ".", "!", "?" before whitespace or the
    end) at or after ``pos``, else ``len(text)``; calls with growing ``pos`` cost one scan of the text in all."""

    def __init__(self, text: str):
        self.text, self.found = text, -1

    def next(self, pos: int) -> int:
        if self.found < pos:
            m = _SENTENCE_END_RE.search(self.text, pos)
            self.found = len(self.text) if m is None else m.start()
        return self.found


def _is_condition(text: str, start: int) -> bool:
    """An answer phrase at ``start`` is in a condition or a check: a :data:`CONDITION_WORDS` word at most two words
    before it ("if the answer is", "check that the answer is", "whether our answer is")."""
    return _CONDITION_RE.search(text[max(0, start - 40):start]) is not None


def statements(text: str) -> list[Statement]:
    """The final-answer statements of a completion (S1-S4 of the module doc), in order, none inside another."""
    base = answer_start(text)
    found = sorted([*_markers(text, base), *_boxes(text, base), *_tags(text, base)], key=lambda t: (t[0], -t[1]))
    marked: list[_Span] = []
    for outer in found:
        if not marked or outer[0] >= marked[-1][1]:
            marked.append(outer)
    phrases, k, ends = [], 0, _SentenceEnds(text)
    for word in _ANSWER_WORD_RE.finditer(text, base):
        after = _PHRASE_AFTER_RE.match(text, word.end())
        lo = max(base, word.start() - 40)
        before = _PHRASE_BEFORE_RE.search(("\n" if lo == base else "") + text[lo:word.start()])
        if after is None or before is None:
            continue
        start = max(lo, word.start() - len(before.group()))
        while k < len(marked) and marked[k][1] <= start:
            k += 1
        if k < len(marked) and marked[k][0] <= start:
            continue  # inside a marked statement: part of it
        bound = min(ends.next(after.end()), marked[k][0] if k < len(marked) else len(text))
        phrases.append((start, after.end(), bound, _is_condition(text, start)))
    out = [Statement(kind, text[start:end], start, end) for _, _, kind, start, end in marked]
    for i, (start, begin, bound, condition) in enumerate(phrases):
        end = max(begin, min(bound, phrases[i + 1][0] if i + 1 < len(phrases) else bound))  # not over the next phrase
        if not condition:
            out.append(Statement("phrase", text[begin:end], begin, end))
    return sorted(out, key=lambda s: s.start)


def values(text: str, *, cleaned: bool = False) -> tuple[list[str], list[str]]:
    """(values, gaps) of a text once cleaned (:func:`clean_text`; ``cleaned``: it is already): its numbers and the
    text around them (:func:`grpo.rewards.numbers.numbers_and_gaps`)."""
    return numbers_and_gaps(text if cleaned else clean_text(text))


def _differ(a: str, b: str) -> bool:
    return a != b and not numbers_equal(a, b)


def _joins(gap: str, after: str, arithmetic: bool, at_answer: bool) -> bool:
    """Whether ``gap`` (the text between two different values; ``after``: the text after the second) makes them
    alternatives (A1-A3 of the module doc); ``at_answer``: one of the two is the answer, so a range or a slash also
    counts (A2)."""
    if _HEDGE_RE.search(gap):
        return True
    bare = _GAP_NOISE_RE.sub("", gap).lower()
    if bare.endswith("(") and _GAP_NOISE_RE.sub("", after).startswith((")", "?)")):
        return True  # the second value alone in parentheses: "3 (4)", "3 (4?)"
    if _LIST_GAP_RE.fullmatch(bare) or (not bare and "{" not in gap and "}" not in gap):
        return True  # a separator, or spacing alone ("3 4"); braces alone are LaTeX structure ("\\frac{\\sqrt{3}}{2}")
    return at_answer and (_WORD_RANGE_RE if arithmetic else _RANGE_GAP_RE).fullmatch(bare) is not None


def _dashes_as_ranges(text: str) -> str:
    """En and figure dashes as " to ": in an expression "-" is a minus, but "3–5" is a range."""
    return text.replace("\u2013", " to ").replace("\u2012", " to ")


def offers_alternatives(text: str, *, answer: str | None = None, arithmetic: bool = False) -> bool:
    """Whether a statement's text offers more than one value (A1-A4 of the module doc): two adjacent values that
    differ, joined by a hedge or as a list, or — when one of them is ``answer`` (every pair when it is None) — as a
    range; or a value with a both-signs mark. ``arithmetic``: the text is an expression (math-verify reads it), where
    "-" and "/" between two numbers are a subtraction and a division, not a range or a choice (an en or figure dash,
    which LaTeX does not write for a minus, still is a range)."""
    vals, gaps = values(_dashes_as_ranges(text) if arithmetic else text)
    if vals and _BOTH_SIGNS_RE.search(text):
        return True
    for i in range(1, len(vals)):
        if _differ(vals[i - 1], vals[i]):
            at_answer = answer is None or not (_differ(vals[i - 1], answer) and _differ(vals[i], answer))
            if _joins(gaps[i], gaps[i + 1], arithmetic, at_answer):
                return True
    return False


def sentence_around(text: str, pos: int) -> tuple[int, int]:
    """(start, end) of the sentence holding index ``pos``: from after the sentence end before it to the sentence end
    at or after it (line breaks, and ".", "!", "?" before whitespace, end sentences)."""
    line_start = text.rfind("\n", 0, pos) + 1
    start = line_start
    for m in _SENTENCE_END_RE.finditer(text, line_start, pos):
        start = m.end()
    m = _SENTENCE_END_RE.search(text, pos)
    return start, (len(text) if m is None else m.start())


def last_value_hedged(sentence: str, *, arithmetic: bool = False) -> bool:
    """S5: the last value of ``sentence`` and the one before it differ and are joined as alternatives (A1-A3) in one
    sentence, or the last value's sentence holds a hedge word before it ("It is 3. Or maybe 4.") or marks both signs
    (A4)."""
    return _last_value(clean_text(_dashes_as_ranges(sentence) if arithmetic else sentence), arithmetic)[1]


def _last_value(clean: str, arithmetic: bool) -> tuple[str | None, bool]:
    """(last value, hedged) of a cleaned text, by S5 of the module doc. Reads only its last few numbers: one C-level
    split of the text, then the values of its end."""
    window = _last_numbers(clean, 3)
    vals, gaps = values(window, cleaned=True)
    if not vals:
        return None, False
    before, after = gaps[-2], gaps[-1]
    ends = list(_SENTENCE_END_RE.finditer(before))
    own = before[ends[-1].end():] if ends else before  # the last value's sentence, up to it
    if _BOTH_SIGNS_RE.search(own):
        return vals[-1], True
    if len(vals) < 2 or not _differ(vals[-2], vals[-1]):
        return vals[-1], False
    return vals[-1], bool(_HEDGE_RE.search(own)) or (not ends and _joins(before, after, arithmetic, at_answer=True))


def _last_numbers(clean: str, count: int) -> str:
    """The end of a cleaned text from its ``count``-th last number on (the whole text when it has fewer). Its last
    4,096 characters are tried first: when they hold two numbers more than needed (the first may be cut), the rest of
    a long text is not split."""
    if len(clean) > 4096:
        window = _numbers_from_end(clean[-4096:], count + 2)
        if window is not None:
            return _numbers_from_end(window, count)
    return _numbers_from_end(clean, count) or clean


def _numbers_from_end(clean: str, count: int) -> str | None:
    """``clean`` from its ``count``-th last number on, or None when it has fewer."""
    pieces = NUMBER_RE.split(clean)  # [text, num, den, text, ...]; positions recovered from the lengths, from the end
    end, found = len(clean), 0
    for k in range(len(pieces) - 3, 0, -3):
        num, den, after = pieces[k], pieces[k + 1], pieces[k + 2]
        end -= len(after) + len(num) + (0 if den is None else len(den) + 1)
        found += normalize_number(num, den) is not None
        if found == count:
            return clean[end:]
    return None


def hedged_after(text: str, statement: Statement, differs: Callable[[str], bool]) -> bool:
    """C4: after ``statement``, in the rest of its sentence or in the next sentence, a hedge word is followed by
    values, the last of which in that sentence satisfies ``differs`` (is other than the answer): "\\boxed{3}. Or maybe
    5." is a hedge, "Answer: 3. We subtract 1 from 4, or equivalently add -1 to 4, to get 3." is not."""
    ends = _SentenceEnds(text)
    first = ends.next(statement.end)
    second = ends.next(first + 1) if first < len(text) else first
    for begin, end in ((statement.end, first), (first, second)):
        hedge = _HEDGE_RE.search(text, begin, end)
        after = values(text[hedge.start():end])[0] if hedge is not None else []
        if after and differs(after[-1]):
            return True
    return False


def number_named(statement: Statement) -> str | None:
    """The number a statement names, canonical (:mod:`grpo.rewards.numbers`), read from its cleaned text: a marker's
    line (S1) its first number (GSM8K's "#### 72 (48 + 24)"); a box (S2) its last number ("x = \\frac{3}{4}");
    a tag or a phrase (S3, S4) the first number after its last "=", else its first ("30 + 5 = 35 flowers", "<<8=8>>8",
    "7, not 3"). None when it has no number."""
    text = clean_text(statement.text)
    if statement.kind == "marker":
        return first_number(text)
    if statement.kind == "boxed":
        last = last_number(text)
        return None if last is None else last[0]
    equals = text.rfind("=")
    return (first_number(text, equals + 1) if equals >= 0 else None) or first_number(text)


def committed_number(text: str, *, clean: str | None = None) -> str | None:
    """The number a completion commits to (canonical), by C1-C4 of the module doc, or None (no number, or a hedge):
    the one every statement that names a number (:func:`number_named`) names, when none offers an alternative and no
    hedge follows the last; without such a statement (S5), its last number in the answer part, unless that is joined
    to the number before it as an alternative. ``clean``: ``clean_text(text)``, when the caller has it (a megabyte
    is not cleaned twice)."""
    found = statements(text)
    reading: dict[tuple[str, str], str | None] = {}  # one reading per distinct statement: restatements cost nothing

    def named(statement: Statement) -> str | None:
        key = (statement.kind, statement.text)
        if key not in reading:
            reading[key] = number_named(statement)
        return reading[key]

    last = next((s for s in reversed(found) if named(s) is not None), None)
    if last is None:
        base = answer_start(text)
        value, hedged = _last_value(clean if clean is not None and base == 0 else clean_text(text[base:]), False)
        return None if hedged else value
    answer, judged = named(last), set()
    for statement in found:
        value = named(statement)
        if value is None or (statement.kind, statement.text) in judged:
            continue
        if _differ(value, answer) or offers_alternatives(statement.text, answer=answer):
            return None
        judged.add((statement.kind, statement.text))
    return None if hedged_after(text, last, lambda v: _differ(v, answer)) else answer


def commits_to_number(text: str, answer: str, *, clean: str | None = None) -> bool:
    """Whether a completion commits to the number ``answer`` (canonical): :func:`committed_number` is equal to it."""
    committed = committed_number(text, clean=clean)
    return committed is not None and not _differ(committed, answer)
