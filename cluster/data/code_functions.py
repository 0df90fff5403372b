"""Short Python functions to write, generated offline (``data.source: code_functions``): one-liners over ints,
strings and lists (add 7, is x divisible by 3, reverse a string, count a letter, the last item of a list, ...) with
a natural-language prompt and call-case tests as data, judged by the sandbox's protected verifier (the ``code``
reward; an agent runs them with :func:`sandbox.test_report.run_tests`).

Rows (:func:`code_function_row`)::

    {"prompt": "Write a Python function `add_number(x)` that returns x plus 7.",
     "tests": [{"args": [3], "expected": 10}, ...], "entry_point": "add_number",
     "family": "add_k", "solution": "def add_number(x):\\n    return x + 7\\n"}

``tests`` are ``data.code_functions.tests`` call cases whose expected values are the reference solution's results
(bools compared with ``is``, so 1 is not True), chosen to cover as many distinct results as the draws allow (a
function that always returns False does not pass a divisibility test). ``solution`` is the reference, for reading
results; nothing the policy sees.

Splits (deterministic, the same on every machine, no network). The problems are the families of
:mod:`cluster.data.code_families`, each a template with a parameter (a constant, or an operation and a function
name). Each family's parameter values are shuffled with ``random.Random(f"{split_seed}:{family}")``; the first
``held_out_fraction`` of them (at least one, never all) are held out. So no held-out function is ever a training
one: a held-out problem is an unseen instance of a family seen in training ("returns x plus 23" when training had
plus 7 and plus 12).

- training item i (0 <= i < ``size``): ``random.Random(seed + i)`` picks a family (uniformly among
  ``families``), one of its training parameter values, and the arguments of its tests;
- held-out: every held-out function once, the families taken in turn (one of each family, then a second of each
  that has one, ...), so a prefix (``eval.limit``) spans the families; item j's tests are drawn with
  ``random.Random(held_out_seed + j)``. At most ``held_out_size`` of them.
"""

from __future__ import annotations

import random
from typing import Any

from cluster.data.code_families import FAMILIES, FAMILY_NAMES, Family, FunctionTask
from cluster.data.rows import DataError, Example, RowFormat, parse_record

__all__ = ["CANDIDATE_DRAWS", "TELLING_DRAWS", "code_function_examples", "code_function_row", "code_function_rows",
           "family_split", "reference_function", "selected_families"]

#: Argument draws per test case; the cases are picked from them to cover distinct results.
CANDIDATE_DRAWS = 6
#: Further draws, at most, for a case that tells the reference from another function of its family.
TELLING_DRAWS = 200


def selected_families(names) -> list[Family]:
    """The families ``names`` lists (all of them, in :data:`FAMILY_NAMES` order, for an empty list).

    Raises:
        DataError: an unknown name, naming the known ones.
    """
    unknown = sorted(set(names) - set(FAMILY_NAMES))
    if unknown:
        raise DataError(f"data.code_functions.families: unknown {unknown}; expected names among {list(FAMILY_NAMES)}")
    return [f for f in FAMILIES if not names or f.name in names]


def family_split(family: Family, held_out_fraction: float, split_seed: int) -> tuple[list, list]:
    """(training parameter values, held-out parameter values) of ``family`` (module doc): the held-out ones are the
    first ``max(1, round(fraction * n))`` (at most n - 1) of the values shuffled with
    ``random.Random(f"{split_seed}:{family.name}")``, in that shuffled order."""
    order = list(family.params)
    random.Random(f"{split_seed}:{family.name}").shuffle(order)
    held = min(max(1, round(held_out_fraction * len(order))), len(order) - 1)
    return order[held:], order[:held]


def reference_function(task: FunctionTask):
    """The reference solution as a callable (compiled from :attr:`FunctionTask.solution`, this project's own text)."""
    namespace: dict[str, Any] = {}
    exec(compile(task.solution, f"<reference {task.name}>", "exec"), namespace)  # noqa: S102 - our template
    return namespace[task.name]


def _cases(family: Family, param: Any, task: FunctionTask, rng: random.Random, count: int) -> list[dict]:
    """At least ``count`` call cases (module doc): arguments drawn ``CANDIDATE_DRAWS`` times per case (distinct
    ones kept), ``count`` of them picked in turn from each distinct result (in the order first seen), then one more
    for each other function of the family that would pass them all: the first drawn case that tells it apart (up to
    ``TELLING_DRAWS`` more draws when none of the first does)."""
    function = reference_function(task)
    drawn: dict[str, tuple[list, Any]] = {}
    for _ in range(CANDIDATE_DRAWS * count):
        args = family.args(param, rng)
        drawn.setdefault(repr(args), (args, None))
    candidates = [(args, function(*args)) for args, _ in drawn.values()]
    by_result: dict[str, list[tuple[list, Any]]] = {}
    for args, result in candidates:
        by_result.setdefault(repr(result), []).append((args, result))
    picked: list[tuple[list, Any]] = []
    queues = list(by_result.values())
    while len(picked) < count and any(queues):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    for other in _siblings(family, task):
        if all(_same(other, args, result) for args, result in picked):
            telling = next((c for c in candidates if not _same(other, *c)), None)
            for _ in range(TELLING_DRAWS if telling is None else 0):
                args = family.args(param, rng)
                if not _same(other, args, function(*args)):
                    telling = (args, function(*args))
                    break
            if telling is not None:
                picked.append(telling)
    return [{"args": args, "expected": result, **({"check": "is"} if isinstance(result, bool) else {})}
            for args, result in picked]


def _siblings(family: Family, task: FunctionTask) -> list:
    """The other functions of ``family`` (other bodies), as callables."""
    bodies = {family.task(p).body for p in family.params} - {task.body}
    return [reference_function(FunctionTask(task.name, task.args, "", body)) for body in sorted(bodies)]


def _same(function, args: list, result: Any) -> bool:
    """``function(*args)`` equals ``result`` (and is of its type); raising counts as different."""
    try:
        value = function(*args)
    except Exception:  # noqa: BLE001 - a sibling raising on these arguments is told apart by them
        return False
    return type(value) is type(result) and value == result


def code_function_row(family: Family, param: Any, rng: random.Random, tests: int) -> dict:
    """One problem's row (module doc) for ``family`` at ``param``, its tests' arguments drawn from ``rng``."""
    task = family.task(param)
    return {"prompt": f"Write a Python function `{task.signature}` that {task.does}.",
            "tests": _cases(family, param, task, rng, tests), "entry_point": task.name, "family": family.name,
            "solution": task.solution}


def code_function_rows(cf, split: str = "train") -> list[dict]:
    """The rows of ``split`` (``train`` or ``held_out``) for the spec's ``data.code_functions`` section ``cf``
    (module doc), in item order.

    Raises:
        DataError: an unknown family name.
    """
    families = selected_families(cf.families)
    splits = {f.name: family_split(f, cf.held_out_fraction, cf.split_seed) for f in families}
    if split == "train":
        rows = []
        for i in range(cf.size):
            rng = random.Random(cf.seed + i)
            family = families[rng.randrange(len(families))]
            params = splits[family.name][0]
            rows.append(code_function_row(family, params[rng.randrange(len(params))], rng, cf.tests))
        return rows
    turns = max(len(held) for _, held in splits.values())
    chosen = [(f, splits[f.name][1][k]) for k in range(turns) for f in families if k < len(splits[f.name][1])]
    return [code_function_row(f, param, random.Random(cf.eval_seed + j), cf.tests)
            for j, (f, param) in enumerate(chosen[:cf.held_out_size])]


def code_function_examples(cf, split: str = "train", checks=()) -> tuple[list[Example], int]:
    """The ``split`` of ``data.code_functions`` as Examples (prompt column ``prompt``, every other column kept;
    the index is the item number), checked by ``checks`` (the row checks of the rewards that score them):
    (examples, 0).

    Raises:
        DataError: an unknown family, or a reward of the job that cannot score the rows (e.g. the GSM8K
            ``accuracy`` reward, which needs an answer column), naming the row.
    """
    fmt = RowFormat("prompt", "answer", tuple(checks), "data.source 'code_functions'")
    examples = []
    for index, row in enumerate(code_function_rows(cf, split)):
        try:
            examples.append(parse_record(row, index, fmt))
        except ValueError as exc:
            raise DataError(f"data.source 'code_functions': {split} item {index} ({row['family']}): {exc}") from None
    return examples, 0
