"""A row's tests (the ``tests`` column the ``code`` rewards read) as typed cases, checked when the data is loaded.

A row's ``tests`` is one of

- a list whose items are cases, each one of
    - a **call case**, a dict with ``args``: ``{"args": [2, 3], "expected": 5}``: the row's ``entry_point`` called
      with ``args`` (a list or tuple of positional arguments) and ``kwargs`` (optional, a dict of str keys); the
      result is compared with ``expected`` by ``check`` (optional): ``eq`` (the default: ``result == expected``),
      ``is`` (``result is expected``, for True, False and None), ``close`` (``abs(result - expected) <
      tolerance``), ``truthy`` or ``falsy`` (``bool(result)``, no ``expected``). ``apply`` (optional: ``tuple``,
      ``list``, ``sorted`` or ``set``) is applied to the result first, as ``tuple(candidate(x)) == ...`` in a test.
      Arguments and expected values are plain data: None, bool, int, float, str, bytes, complex and lists, tuples,
      dicts, sets and frozensets of them (``sandbox.harness``'s wire format);
    - a **stdin/stdout case** ``{"input": str, "output": str}``: the program alone, ``input`` on its stdin, its stdout
      compared with ``output`` once each line's trailing whitespace and the trailing empty lines are dropped;
    - a str: **test code** (assert style), run after the program in its process;
- a dict ``{"inputs": [str, ...], "outputs": [str, ...]}`` (the APPS/TACO layout): stdin/stdout cases zipped;
- a str: test code, one case.

Call and stdin/stdout cases are judged outside the program's process, on plain data it cannot forge into a pass;
test code runs inside it and only the ``code_asserts`` reward accepts it (docs/sandbox.md, "Test styles").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from sandbox.harness import APPLY, encode

__all__ = ["AssertCase", "CallCase", "Case", "Check", "StdioCase", "parse_tests"]

Check = Literal["eq", "is", "close", "truthy", "falsy"]
_CALL_KEYS = {"args", "kwargs", "expected", "check", "tolerance", "apply"}


@dataclass(frozen=True)
class CallCase:
    """Call the entry point with ``args``/``kwargs``; the result (``apply`` applied) passes ``check`` against
    ``expected`` (module doc). ``tolerance``: for ``close`` only."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    expected: Any = None
    check: Check = "eq"
    tolerance: float | None = None
    apply: str | None = None


@dataclass(frozen=True)
class StdioCase:
    """The program alone with ``stdin``; its stdout must equal ``stdout`` (normalised)."""

    stdin: str
    stdout: str


@dataclass(frozen=True)
class AssertCase:
    """Python test code run after the program, in its process."""

    code: str


Case = CallCase | StdioCase | AssertCase


def _plain(value: Any, what: str) -> None:
    """Raise ValueError unless ``value`` is plain data (what the wire format carries)."""
    try:
        encode(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not plain data: {exc}") from None


def _call_case(case: Mapping, what: str) -> CallCase:
    """One call case (module doc), checked. Raises ValueError naming ``what`` (``case 3``) and the key."""
    unknown = sorted(set(case) - _CALL_KEYS)
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {unknown}; a call case has {sorted(_CALL_KEYS)}")
    args, kwargs = case["args"], case.get("kwargs", {})
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"{what}: args must be a list of positional arguments, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{what}: kwargs must be a dict with str keys, got {kwargs!r:.80}")
    check = case.get("check", "eq")
    if check not in get_args(Check):
        raise ValueError(f"{what}: check must be one of {list(get_args(Check))}, got {check!r}")
    apply = case.get("apply")
    if apply is not None and apply not in APPLY:
        raise ValueError(f"{what}: apply must be one of {sorted(APPLY)} or absent, got {apply!r}")
    has_expected = "expected" in case
    expected, tolerance = case.get("expected"), case.get("tolerance")
    if check in ("truthy", "falsy") and has_expected:
        raise ValueError(f"{what}: check {check!r} takes no expected value")
    if check not in ("truthy", "falsy") and not has_expected:
        raise ValueError(f"{what}: check {check!r} needs an expected value")
    if check == "is" and not any(expected is x for x in (True, False, None)):
        raise ValueError(f"{what}: check 'is' compares with True, False or None, got {expected!r:.80}")
    if check == "close":
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (expected, tolerance))
        if not numbers or not math.isfinite(tolerance) or tolerance <= 0 or not math.isfinite(expected):
            raise ValueError(f"{what}: check 'close' needs a finite number expected and a tolerance > 0, got "
                             f"expected={expected!r:.40}, tolerance={tolerance!r}")
    elif tolerance is not None:
        raise ValueError(f"{what}: tolerance is for check 'close' only")
    _plain(list(args), f"{what}: args")
    _plain(dict(kwargs), f"{what}: kwargs")
    _plain(expected, f"{what}: expected")
    return CallCase(tuple(args), dict(kwargs), expected, check, tolerance, apply)


def parse_tests(tests: Any, row: int | None = None, *, entry_point: str | None = None) -> list[Case]:
    """A row's ``tests`` value as cases (module doc).

    Args:
        tests: the row's ``tests`` value.
        row: the row's 0-based index in the batch, for messages (None: checked alone, the loader names the row).
        entry_point: the row's ``entry_point``: needed by call cases.

    Raises:
        ValueError: no tests, a case of another shape, a call case without an entry point, values that are not plain
            data; the message names the row and case and says what was expected.
    """
    where = f"row {row}: " if row is not None else ""

    def bad(what: str) -> ValueError:
        return ValueError(f"code reward: {where}{what}; expected a list of cases (call cases {{'args': [...], "
                          f"'expected': ...}}, {{'input': str, 'output': str}} or Python test code), "
                          f"{{'inputs': [...], 'outputs': [...]}}, or test code (str)")

    if tests is None or (isinstance(tests, (str, Sequence, Mapping)) and len(tests) == 0):
        raise bad(f"has no tests ({tests!r})")
    if isinstance(tests, str):
        return [AssertCase(tests)]
    if isinstance(tests, Mapping):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not (isinstance(inputs, Sequence) and isinstance(outputs, Sequence)) or len(inputs) != len(outputs):
            raise bad(f"a dict of tests needs equal-length 'inputs' and 'outputs' lists, got keys {sorted(tests)}")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(tests, Sequence):
        raise bad(f"tests of type {type(tests).__name__}")
    cases: list[Case] = []
    for k, case in enumerate(tests):
        if isinstance(case, str) and case.strip():
            cases.append(AssertCase(case))
        elif isinstance(case, Mapping) and "args" in case:
            if not (isinstance(entry_point, str) and entry_point.isidentifier()):
                raise ValueError(f"code reward: {where}case {k} is a call case, which calls the row's entry_point; "
                                 f"expected an entry_point column naming the function, got {entry_point!r}")
            try:
                cases.append(_call_case(case, f"case {k}"))
            except ValueError as exc:
                raise ValueError(f"code reward: {where}{exc}") from None
        elif isinstance(case, Mapping) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str):
            cases.append(StdioCase(case["input"], case["output"]))
        else:
            raise bad(f"case {k} is {case!r:.80}")
    return cases
