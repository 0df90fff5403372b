"""Prompt data: GSM8K-style jsonl loading, a deterministic resumable prompt sampler, chat prompts and their token ids.

Row format (one JSON object per line, UTF-8; blank lines ignored)::

    {"question": "Natalia sold clips to 48 ...", "answer": "Natalia sold 48/2 = 24 ...\\n#### 72"}

The reference (final) answer is the text after the last ``####`` in the answer, stripped (``"72"``); it must hold a
number (``grpo.rewards.gsm8k.parse_reference``, which the accuracy reward uses), else the row is bad. GSM8K (MIT)
is at ``../shared/data/gsm8k/{train,test}.jsonl`` on the project machines, or from
https://github.com/openai/grade-school-math (``grade_school_math/data/``).

The package also holds the other prompt sources (``sources``: local Hugging Face ``datasets`` files, reasoning-gym
tasks), model resolution (``models``: builtin aliases, HF folders, hub ids) and evaluation (``evaluate``: pass@1 with
the engine). May import ``grpo.rewards`` (answer parsing), ``cluster.spec``, transformers
and, inside ``evaluate``, vLLM and ``rollout_workers.engine``; never ``cluster.loop`` or ``cluster.ops``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grpo.rewards.gsm8k import parse_reference

__all__ = ["DataError", "Example", "extract_reference", "load_jsonl_examples", "parse_record", "PromptSampler",
           "build_chat_prompt", "chat_prompt_ids"]

ANSWER_MARKER = "####"

_HOW_TO_GET_DATA = (
    "Point data.train_path (and data.test_path) at a GSM8K-style jsonl file with one JSON object per line and "
    "fields 'question' and 'answer' (the answer ending in '#### <final answer>'), e.g. "
    "../shared/data/gsm8k/train.jsonl, or download GSM8K from https://github.com/openai/grade-school-math "
    "(grade_school_math/data/train.jsonl) or the Hugging Face dataset 'openai/gsm8k' (config 'main')."
)


class DataError(ValueError):
    """A data file is missing or holds a malformed row; the message names ``file:line``."""


@dataclass(frozen=True)
class Example:
    """One prompt row.

    index: 0-based position of the row among the file's non-blank lines (stable whether bad rows are skipped or
    not; use it as the prompt id). question: the question text. answer: the full answer field. reference: the
    final answer after the last '####', stripped.
    """

    index: int
    question: str
    answer: str
    reference: str


def extract_reference(answer: str) -> str:
    """The final answer after the last '####' in ``answer``, stripped; raises ValueError if there is none."""
    head, marker, tail = answer.rpartition(ANSWER_MARKER)
    if not marker:
        raise ValueError(f"answer has no {ANSWER_MARKER!r} marker (expected '... {ANSWER_MARKER} <final answer>')")
    reference = tail.strip()
    if not reference:
        raise ValueError(f"answer has nothing after its {ANSWER_MARKER!r} marker")
    return reference


def _parse_row(raw: bytes, index: int, question_field: str, answer_field: str) -> Example:
    """One non-blank line → Example; raises ValueError with the reason (no location)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte {exc.start} of the line") from None
    text = text.rstrip("\r\n")  # the line break is not part of the row; with it, errors at the end point past it
    try:
        row: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.pos + 1}") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object with fields {question_field!r} and {answer_field!r}, "
                         f"got {type(row).__name__}")
    return parse_record(row, index, question_field, answer_field)


def parse_record(row: dict[str, Any], index: int, question_field: str, answer_field: str) -> Example:
    """One row as a dict (a JSON object, or a row of a Hugging Face dataset) → Example; raises ValueError with the
    reason (no location): missing/non-string field, not valid Unicode, empty question, answer without '####' or
    without a number after it."""
    values = []
    for field in (question_field, answer_field):
        if field not in row:
            raise ValueError(f"missing field {field!r}; the row has {sorted(row) or 'no fields'}")
        if not isinstance(row[field], str):
            raise ValueError(f"field {field!r}: expected a string, got {type(row[field]).__name__}")
        try:  # JSON escapes can spell lone surrogates ("\ud800"): valid JSON, but no text a tokenizer can encode
            row[field].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"field {field!r}: not valid Unicode text (a lone surrogate at character "
                             f"{exc.start})") from None
        values.append(row[field])
    question, answer = values
    if not question.strip():
        raise ValueError(f"field {question_field!r} is empty")
    reference = extract_reference(answer)
    try:
        parse_reference(reference)  # what the driver hands the reward functions
    except ValueError:
        raise ValueError(f"field {answer_field!r}: expected a number after the last {ANSWER_MARKER!r} (the accuracy "
                         f"reward compares numbers), got {_short(reference)}") from None
    return Example(index=index, question=question, answer=answer, reference=reference)


def _short(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit - 3] + "...")


def load_jsonl_examples(path: str | Path, *, question_field: str = "question", answer_field: str = "answer",
                        on_bad_row: Literal["error", "skip"] = "error") -> tuple[list[Example], int]:
    """Read a GSM8K-style jsonl file.

    Returns (examples, skipped): skipped counts bad rows dropped with ``on_bad_row="skip"``. Raises DataError for a
    missing/unreadable file, a file without usable rows, or (``on_bad_row="error"``) the first bad row as
    ``file:line: reason`` (invalid UTF-8 or JSON, not an object, missing/non-string field, empty question, answer
    without '####' or without a number after it, see ``grpo.rewards.gsm8k.parse_reference``).
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row: expected 'error' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise DataError(f"data file {path} {what} (absolute: {path.absolute()}). {_HOW_TO_GET_DATA}")
    examples: list[Example] = []
    skipped = 0
    index = 0
    try:
        with path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    examples.append(_parse_row(raw, index, question_field, answer_field))
                except ValueError as exc:
                    if on_bad_row == "error":
                        hint = "set data.on_bad_row: skip to drop bad rows"
                        raise DataError(f"{path}:{line_no}: {exc} ({hint})") from None
                    skipped += 1
                index += 1
    except OSError as exc:
        raise DataError(f"{path}: cannot read data file: {exc}") from None
    if not examples:
        raise DataError(f"{path}: no usable rows ({skipped} bad rows skipped, {index} rows in all). "
                        f"{_HOW_TO_GET_DATA}")
    return examples, skipped


class PromptSampler:
    """Deterministic, resumable batches of B prompts, epoch by epoch.

    Epoch e visits every example once in the order ``random.Random(seed * 1000003 + e)`` shuffles (file order
    when ``shuffle=False``). A batch that reaches the end of an epoch takes the rest of it and continues with the
    next epoch's order, so every batch has exactly ``batch_size`` examples. State is (epoch, offset): the next
    example is position ``offset`` of epoch ``epoch``'s order; ``state_dict``/``load_state_dict`` resume exactly.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, shuffle: bool = True):
        if not examples:
            raise ValueError("PromptSampler: expected at least one example, got 0")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: expected batch_size >= 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Number of examples per epoch."""
        return len(self.examples)

    def epoch_order(self, epoch: int) -> list[int]:
        """Positions into ``examples`` in the order epoch ``epoch`` visits them."""
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Example]:
        """The next ``batch_size`` examples; advances (epoch, offset)."""
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
            take = self._order[self.offset:self.offset + self.batch_size - len(batch)]
            batch.extend(self.examples[i] for i in take)
            self.offset += len(take)
            if self.offset == len(self.examples):
                self.epoch, self.offset = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position plus what must match on resume (seed, shuffle, num_examples)."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` output; raises ValueError if it came from different data or seed."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_examples", len(self.examples))):
            if key in state and state[key] != mine:
                raise ValueError(f"PromptSampler.load_state_dict: {key}: expected {mine!r} (this sampler), "
                                 f"got {state[key]!r} (saved state)")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < len(self.examples):
            raise ValueError(f"PromptSampler.load_state_dict: expected epoch >= 0 and 0 <= offset < "
                             f"{len(self.examples)}, got epoch={epoch}, offset={offset}")
        self.epoch, self.offset = epoch, offset


def build_chat_prompt(example: Example, system_prompt: str | None, prompt_suffix: str = "") -> list[dict[str, str]]:
    """Chat messages for one example: an optional system message, then the user message question + suffix.

    The suffix is appended as is (include any separating newline in it). The caller applies the tokenizer's chat
    template.
    """
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": example.question + prompt_suffix})
    return messages


def chat_prompt_ids(tokenizer, examples: Sequence[Example], system_prompt: str | None,
                    prompt_suffix: str = "") -> list[list[int]]:
    """Token ids of each example's chat prompt (`build_chat_prompt` + the tokenizer's chat template with the
    generation prompt): the one place prompts become token ids, for training (the driver), eval and the engine.

    The chat template writes every special token the prompt needs, BOS included; the text is then tokenized with
    ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does. Tokenizing it with special tokens
    (what ``tokenizer(text)`` and vLLM's text prompts do) puts a second BOS in front on tokenizers whose template
    writes BOS and whose post-processor adds it again (Llama 3). Callers hand these ids to vLLM as token prompts, so
    the engine adds nothing either.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        examples: the rows to render.
        system_prompt, prompt_suffix: as in `build_chat_prompt`.

    Returns:
        one list of int token ids per example, in order.
    """
    texts = [tokenizer.apply_chat_template(build_chat_prompt(ex, system_prompt, prompt_suffix), tokenize=False,
                                           add_generation_prompt=True) for ex in examples]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
