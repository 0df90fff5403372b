"""Prompt sources beside jsonl: local Hugging Face ``datasets`` files and reasoning-gym tasks; :func:`load_examples`
picks the one ``data.source`` names.

- ``jsonl`` (default): :func:`cluster.data.load_jsonl_examples` on ``data.train_path`` / ``data.test_path``.
- ``hf_datasets``: ``datasets.load_dataset(data.file_format, data_files=path, split=data.split)`` (parquet, arrow,
  json/jsonl or csv files, or a glob of them); each row is checked like a jsonl row
  (:func:`cluster.data.parse_record`: question/answer columns named by ``data.question_field`` /
  ``data.answer_field``, the answer ending in ``#### <number>``); bad rows stop or are skipped per
  ``data.on_bad_row``, named ``file:row N``. Needs the ``datasets`` package (``grpo-cluster[data]``).
- ``reasoning_gym``: problems 0..size-1 of ``data.reasoning_gym.task`` generated with its ``seed`` (training) or
  ``eval_seed`` (held-out); the reference of each is the JSON the ``reasoning_gym`` reward decodes
  (``grpo.rewards.reasoning_gym.encode_reference``). Held-out problems whose question text also appears in the
  training split are dropped (small task spaces repeat problems across seeds) and counted as skipped. Needs
  ``reasoning-gym`` (``grpo-cluster[tasks]``).

The ``held_out`` split of a file source reads ``data.test_path``. Example indices are row positions in the source
(0-based), stable whether bad rows are skipped or not, so they serve as prompt ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from cluster.data import DataError, Example, load_jsonl_examples, parse_record

__all__ = ["Split", "describe_source", "load_examples", "load_hf_examples", "reasoning_gym_examples"]

Split = Literal["train", "held_out"]


def _path(data, split: Split) -> tuple[str, str]:
    """(the spec field, its path) a file source reads for ``split``; DataError when that field is unset."""
    field, path = ("train_path", data.train_path) if split == "train" else ("test_path", data.test_path)
    if not path:
        raise DataError(f"data.{field}: not set; the {split} split of data.source {data.source!r} reads it")
    return field, path


def describe_source(data, split: Split = "train") -> str:
    """Where ``split`` comes from, for status lines: a path, or ``reasoning-gym chain_sum (seed 0, 2000 problems)``."""
    if data.source == "reasoning_gym":
        rg = data.reasoning_gym
        seed, size = (rg.seed, rg.size) if split == "train" else (rg.eval_seed, rg.held_out_size)
        return f"reasoning-gym {rg.task} (seed {seed}, {size} problems)"
    path = data.train_path if split == "train" else data.test_path
    return path if data.source == "jsonl" else f"{path} ({data.file_format}, split {data.split!r})"


def load_hf_examples(path: str, *, file_format: str = "parquet", split: str = "train", question_field: str = "question",
                     answer_field: str = "answer", on_bad_row: Literal["error", "skip"] = "error",
                     ) -> tuple[list[Example], int]:
    """Rows of local ``datasets`` files as Examples.

    Args:
        path: a file, or a glob (``data/*.parquet``), handed to ``load_dataset`` as ``data_files``.
        file_format: the packaged builder: ``parquet``, ``arrow``, ``json`` (json or jsonl) or ``csv``.
        split: the split to read (``train`` for local files unless data_files maps splits).
        question_field, answer_field, on_bad_row: as for :func:`cluster.data.load_jsonl_examples`.

    Returns:
        (examples, skipped), as :func:`cluster.data.load_jsonl_examples`.

    Raises:
        DataError: ``datasets`` not installed, no file matches, the files cannot be read as ``file_format``, an
            unknown split, a missing column, a bad row (``on_bad_row="error"``), or no usable rows.
    """
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"data.source 'hf_datasets' needs the datasets package ({exc}); "
                        f"pip install 'grpo-cluster[data]'") from None
    try:
        table = datasets.load_dataset(file_format, data_files=str(Path(path).expanduser()), split=split)
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for unreadable input; all are bad data
        raise DataError(f"{path}: cannot load as {file_format!r} files, split {split!r}: "
                        f"{type(exc).__name__}: {exc}") from None
    missing = [c for c in (question_field, answer_field) if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r}; the {file_format} data has columns {table.column_names} "
                        f"(set data.question_field / data.answer_field)")
    examples: list[Example] = []
    skipped = 0
    for index, row in enumerate(table.select_columns([question_field, answer_field])):
        try:
            examples.append(parse_record(dict(row), index, question_field, answer_field))
        except ValueError as exc:
            if on_bad_row == "error":
                raise DataError(f"{path}:row {index}: {exc} (set data.on_bad_row: skip to drop bad rows)") from None
            skipped += 1
    if not examples:
        raise DataError(f"{path}: no usable rows ({skipped} bad rows skipped, {len(table)} rows in all)")
    return examples, skipped


def reasoning_gym_examples(rg, split: Split = "train") -> tuple[list[Example], int]:
    """The problems of ``rg`` (the spec's ``data.reasoning_gym``) for ``split`` as Examples.

    Returns:
        (examples, dropped): ``dropped`` counts held-out problems whose question is also a training one (0 for
        the training split).

    Raises:
        DataError: reasoning-gym missing or refusing the task, or every held-out problem is also a training one.
    """
    from grpo.rewards.reasoning_gym import encode_reference, generate_entries

    config = dict(rg.config)
    seed, size = (rg.seed, rg.size) if split == "train" else (rg.eval_seed, rg.held_out_size)
    try:
        entries = generate_entries(rg.task, config, seed, size)
        seen = ({e["question"] for e in generate_entries(rg.task, config, rg.seed, rg.size)}
                if split == "held_out" else set())
    except (ImportError, ValueError, TypeError, AssertionError) as exc:
        raise DataError(f"data.reasoning_gym: cannot generate task {rg.task!r}: {exc}") from None
    examples = [Example(index=i, question=e["question"], answer=str(e["answer"]),
                        reference=encode_reference(rg.task, config, seed, size, i, rg.answer_extraction,
                                                   rg.partial_credit))
                for i, e in enumerate(entries) if e["question"] not in seen]
    if not examples:
        raise DataError(f"data.reasoning_gym: all {size} held-out problems of {rg.task!r} also appear among the "
                        f"{rg.size} training ones; the task's space is too small for a held-out split: widen its "
                        f"config or reduce data.reasoning_gym.size")
    return examples, len(entries) - len(examples)


def load_examples(data, split: Split = "train") -> tuple[list[Example], int]:
    """``split`` of the spec's ``data`` section from the source it names: (examples, skipped rows).

    Raises:
        DataError: as the source's loader, prefixed with the spec field it read (``data.train_path: ...``).
    """
    if data.source == "reasoning_gym":
        return reasoning_gym_examples(data.reasoning_gym, split)
    field, path = _path(data, split)
    try:
        if data.source == "hf_datasets":
            return load_hf_examples(path, file_format=data.file_format, split=data.split,
                                    question_field=data.question_field, answer_field=data.answer_field,
                                    on_bad_row=data.on_bad_row)
        return load_jsonl_examples(path, question_field=data.question_field, answer_field=data.answer_field,
                                   on_bad_row=data.on_bad_row)
    except DataError as exc:
        raise DataError(f"data.{field}: {exc}") from None
