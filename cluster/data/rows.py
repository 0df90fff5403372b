"""One data row → an :class:`Example`: its prompt (text or chat messages), its other columns, its reference, and the
checks of the rewards the job uses; and the accounting of refused rows with advice that never drops every row.

A row is a mapping (a JSON object of a jsonl line, a row of a ``datasets`` table). Its prompt is the column
``data.prompt_field`` names (unset: ``data.question_field``, default ``question``, the GSM8K layout): a non-empty
string, or a non-empty list of ``{"role": ..., "content": ...}`` chat messages. Every other column is kept as is and
reaches whole-row rewards as a keyword of the same name. The answer column (``data.answer_field``, default
``answer``) is optional; when present its text, after its last ``####`` when it has one, is the row's reference, what
``(completions, references)`` rewards get. A row is refused only for an unusable prompt or for what a reward the job
uses asks of it (``grpo.rewards.checks``): never for a format no reward asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ANSWER_MARKER", "BadRows", "DataError", "Example", "RowFormat", "as_example", "extract_reference",
           "parse_record", "reference_of", "row_columns", "SPEC_RELATIVE_PATHS"]

ANSWER_MARKER = "####"
#: Where a relative path written in a spec is looked for (``cluster.spec.loading``): said when one is not found.
SPEC_RELATIVE_PATHS = (
    "a relative path in the spec is looked for next to the spec file first, then in the working folder")
#: Column names that usually hold the prompt, suggested when the configured one is missing.
_LIKELY_PROMPT_COLUMNS = ("prompt", "question", "problem", "input", "instruction", "query", "messages", "text")
_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file is missing or holds a malformed row; the message names ``file:line`` (or ``file:row N``)."""


@dataclass(frozen=True)
class Example:
    """One prompt row.

    Attributes:
        index: 0-based position of the row in its source (stable whether bad rows are skipped or not; the prompt id).
        question: the prompt's text: the prompt string, or the last user message's content of a chat prompt (it
            identifies the problem in per-problem files and held-out deduplication).
        answer: the answer column's text ("" when the row has none; non-string values as JSON).
        reference: what ``(completions, references)`` rewards get: the text after the answer's last '####',
            stripped, when it has one; else the answer as written.
        prompt: the prompt as the data gave it (the string, or the list of chat messages); None means ``question``.
        columns: every column of the row but the prompt (the answer column included), for whole-row rewards.
    """

    index: int
    question: str
    answer: str = ""
    reference: str = ""
    prompt: str | list[dict[str, str]] | None = None
    columns: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt_as_given(self) -> str | list[dict[str, str]]:
        """The prompt as the data gave it, what whole-row rewards get as ``prompts``."""
        return self.question if self.prompt is None else self.prompt


def row_columns(rows: Sequence[Example]) -> dict[str, list]:
    """Column name → one value per row (None where a row lacks the column), over the union of the rows' columns:
    the ``columns`` whole-row rewards get (``grpo.rewards.combine_rewards``)."""
    names = sorted({k for ex in rows for k in ex.columns})
    return {k: [ex.columns.get(k) for ex in rows] for k in names}


def as_example(row: Example | str) -> Example:
    """An Example, or a bare reference string as one (prompt "", no columns), for callers that have only
    references."""
    return row if isinstance(row, Example) else Example(index=-1, question="", answer=row, reference=row)


@dataclass(frozen=True)
class RowFormat:
    """How rows are read.

    Attributes:
        prompt_field: the prompt column. answer_field: the answer column (optional in a row).
        checks: the load-time checks of the rewards the job uses (``grpo.rewards.checks.row_checks``).
        prompt_setting: how the spec chose ``prompt_field``, for messages.
    """

    prompt_field: str = "question"
    answer_field: str = "answer"
    checks: tuple = ()
    prompt_setting: str = "data.prompt_field"

    @classmethod
    def from_spec(cls, data, checks: Sequence = ()) -> RowFormat:
        """The format of a spec's ``data`` section: ``data.prompt_field``, or ``data.question_field`` when unset."""
        if data.prompt_field is not None:
            return cls(data.prompt_field, data.answer_field, tuple(checks), "data.prompt_field")
        return cls(data.question_field, data.answer_field, tuple(checks),
                   f"data.prompt_field (unset, so data.question_field {data.question_field!r})")


def extract_reference(answer: str) -> str:
    """The final answer after the last '####' in ``answer``, stripped; raises ValueError if there is none."""
    head, marker, tail = answer.rpartition(ANSWER_MARKER)
    if not marker:
        raise ValueError(f"answer has no {ANSWER_MARKER!r} marker (expected '... {ANSWER_MARKER} <final answer>')")
    reference = tail.strip()
    if not reference:
        raise ValueError(f"answer has nothing after its {ANSWER_MARKER!r} marker")
    return reference


def reference_of(answer: str) -> str:
    """The reference of an answer text: after its last '####', stripped, when it has one; else the text as is."""
    head, marker, tail = answer.rpartition(ANSWER_MARKER)
    return tail.strip() if marker else answer


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def _check_text(name: str, text: str) -> None:
    """JSON escapes can spell lone surrogates ("\\ud800"): valid JSON, but no text a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name}: not valid Unicode text (a lone surrogate at character {exc.start})") from None


def _missing_prompt(row: Mapping[str, Any], fmt: RowFormat) -> ValueError:
    keys = sorted(map(str, row))
    likely = next((k for k in _LIKELY_PROMPT_COLUMNS if k in row), None)
    hint = (f"set data.prompt_field: {likely}" if likely is not None
            else "set data.prompt_field to the column that holds the prompt")
    return ValueError(f"no prompt column {fmt.prompt_field!r} ({fmt.prompt_setting}); the row has keys "
                      f"{keys or 'none'}: {hint}")


def _messages(name: str, value: list) -> tuple[list[dict[str, str]], str]:
    """A chat-message prompt checked: (the messages, the last user message's content)."""
    if not value:
        raise ValueError(f"field {name!r}: an empty list of chat messages")
    for i, msg in enumerate(value):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
            raise ValueError(f"field {name!r}: message {i}: expected {{'role': str, 'content': str}}, got "
                             f"{_short(msg)}")
        if msg["role"] not in _ROLES:
            raise ValueError(f"field {name!r}: message {i}: role {msg['role']!r}, expected one of {_ROLES}")
        _check_text(f"field {name!r}: message {i}", msg["content"])
    users = [m["content"] for m in value if m["role"] == "user"]
    if not users or not any(u.strip() for u in users):
        raise ValueError(f"field {name!r}: expected at least one non-empty 'user' message")
    return [dict(m) for m in value], users[-1]


def _answer_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_record(row: Mapping[str, Any], index: int, fmt: RowFormat = RowFormat()) -> Example:
    """One row as a mapping (a JSON object, or a row of a ``datasets`` table) → Example.

    Raises:
        ValueError: the reason, without location: no prompt column (the message lists the row's keys and suggests
            ``data.prompt_field``), a prompt that is neither a non-empty string nor a list of chat messages, text
            that is not valid Unicode, or a refusal of one of ``fmt.checks`` (naming the reward and its field).
    """
    if fmt.prompt_field not in row:
        raise _missing_prompt(row, fmt)
    value = row[fmt.prompt_field]
    if isinstance(value, str):
        _check_text(f"field {fmt.prompt_field!r}", value)
        if not value.strip():
            raise ValueError(f"field {fmt.prompt_field!r} is empty")
        prompt, question = value, value
    elif isinstance(value, list):
        prompt, question = _messages(fmt.prompt_field, value)
    else:
        raise ValueError(f"field {fmt.prompt_field!r}: expected a string or a list of {{role, content}} chat "
                         f"messages, got {type(value).__name__}")
    columns = {str(k): v for k, v in row.items() if k != fmt.prompt_field}
    has_answer = fmt.answer_field in columns and columns[fmt.answer_field] is not None
    answer = _answer_text(columns[fmt.answer_field]) if has_answer else ""
    if has_answer:
        _check_text(f"field {fmt.answer_field!r}", answer)
    reference = reference_of(answer)
    for check in fmt.checks:
        try:
            check(prompt, columns, reference if has_answer else None)
        except ValueError as exc:
            about = "" if not check.needs_reference else (
                f"; data.answer_field {fmt.answer_field!r} = {_short(answer)}" if has_answer else
                f"; data.answer_field is {fmt.answer_field!r} and the row has keys {sorted(map(str, row))}")
            raise ValueError(f"reward {check.name!r} ({check.field}) cannot score this row: {exc}{about}") from None
    return Example(index=index, question=question, answer=answer, reference=reference, prompt=prompt,
                   columns=columns)


class BadRows:
    """The rows a loader refused: how many, and where and why the first few were (:attr:`SHOWN`).

    Args:
        source: the file (or files) read, for messages.
    """

    #: Refused rows named in a message (the first in full, the next ones with their reason cut to 240 characters).
    SHOWN = 5

    def __init__(self, source: str):
        self.source, self.count, self.total = source, 0, 0
        self.refused: list[tuple[str, str]] = []

    @property
    def first(self) -> tuple[str, str] | None:
        """(where, reason) of the first refused row, or None."""
        return self.refused[0] if self.refused else None

    def add(self, where: str, reason: str) -> None:
        """Record a refused row at ``where`` (``file:line``) for ``reason``."""
        self.count += 1
        if len(self.refused) < self.SHOWN:
            self.refused.append((where, reason))

    def others(self) -> str:
        """The refused rows after the first, for the end of a message: ``". Also refused: f:7: why; f:9: why (and N
        more)"``, or ``""`` when only one row was refused."""
        if self.count < 2:
            return ""
        named = "; ".join(f"{where}: {reason if len(reason) <= 240 else reason[:237] + '...'}"
                          for where, reason in self.refused[1:])
        more = self.count - len(self.refused)
        return f". Also refused: {named}" + (f" (and {more} more)" if more else "")

    def error(self) -> DataError:
        """The DataError for ``on_bad_row: error``: the first refused row, and advice. ``on_bad_row: skip`` is
        advised only when some rows are usable; when every row is refused, skipping would drop them all, so the
        advice is to fix the data or the settings the message names."""
        where, reason = self.first
        if self.count < self.total:
            advice = (f"{self.count} of {self.total} rows are refused; set data.on_bad_row: skip to drop them, or fix "
                      f"them")
        else:
            advice = (f"all {self.total} rows are refused, so data.on_bad_row: skip would drop every one: fix the "
                      f"data or the data.* setting named above")
        return DataError(f"{where}: {reason} ({advice}){self.others()}")

    def empty(self, kept: int) -> DataError | None:
        """The DataError when no row was kept (``on_bad_row: skip`` refused them all, or there were none)."""
        if kept:
            return None
        first = f"; the first refused: {self.first[0]}: {self.first[1]}{self.others()}" if self.first else ""
        return DataError(f"{self.source}: no usable rows ({self.count} bad rows skipped, {self.total} rows in "
                         f"all){first}")
