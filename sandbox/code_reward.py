"""The ``code`` and ``code_asserts`` rewards: run a completion's Python program against its row's tests in the sandbox,
and pay only on evidence that every test ran and passed.

    REWARD_FUNCTIONS["code"](completions=["```python\\ndef add(a, b):\\n    return a + b\\n```"],
                             tests=[[{"args": [2, 3], "expected": 5}]], entry_point=["add"])  # [1.0]

Contract. Keyword arguments in TRL's convention; the reward reads the row's ``tests`` column (forms in
``sandbox.cases``) and, for call cases and function-completion rows, ``entry_point`` and ``starter_code``. The
program is :func:`sandbox.programs.assemble_program` of what :func:`sandbox.programs.extract_program` finds.

Test styles, and which reward runs them (docs/sandbox.md, "Test styles", lists the hacks each stops):

- call cases (``{"args": [...], "expected": ...}``): every call of a row runs in one program, under the harness
  (``sandbox.harness``), whose frames carry each result as plain data to the judge (``sandbox.judge``) in this
  process; the expected values never enter the sandbox. Both rewards.
- stdin/stdout cases: one program each; the judge compares its stdout. Both rewards.
- test code (a str): one program each; the tests run in the program's own process, after it, and pass only on the
  run's secret nonce, written by the harness after the tests returned. Only ``code_asserts``: the spec chooses it
  explicitly (``algorithm.rewards``, ``eval.accuracy_reward``), since inside the program's process some hacks
  cannot be stopped. ``code`` refuses such rows when the data is loaded (its ``check_row``) and when called.

Score: 1.0 when every case passes, else 0.0; with ``partial_credit=True`` the fraction of cases that pass. None
("no score") when any program of the row hit an infrastructure failure (``SandboxResult.status == "infra_error"``):
the sandbox, not the policy, failed, and a 0 would train on it; the caller excludes such rows and counts them. A row
without tests (None, "", [], {}) or with a malformed case raises ValueError naming the row: bad data, not a policy
failure. All programs of a batch run in one ``run_programs`` call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox.cases import AssertCase, CallCase, Case, StdioCase, parse_tests
from sandbox.config import DEFAULT_SANDBOX, Program, SandboxConfig, SandboxResult
from sandbox.judge import (Verdict, asserts_request, calls_request, judge_asserts, judge_calls, judge_stdio,
                           new_nonce)
from sandbox.programs import assemble_program, extract_program
from sandbox.runner import run_programs

__all__ = ["ASSERTS_REFUSED", "check_code_asserts_row", "check_code_row", "code_asserts_reward", "code_reward"]

logger = logging.getLogger(__name__)

#: Why ``code`` refuses test code (the end of its message).
ASSERTS_REFUSED = (
    "is Python test code, which runs inside the program's own process, where the program can end it, rig the "
    "objects it compares or read it; reward 'code' runs only call cases ({'args': [...], 'expected': ...}) and "
    "stdin/stdout cases, judged outside that process. Convert the tests, or choose the reward 'code_asserts' "
    "(algorithm.rewards, eval.accuracy_reward) to run test code in the program's process: docs/sandbox.md lists "
    "what that does not catch")


@dataclass(frozen=True)
class _Run:
    """One program of a row: what runs, which of the row's cases it decides, and how."""

    program: Program
    cases: list[int]
    judge: Callable[[SandboxResult], list[Verdict]]


def _row_runs(code: str, cases: list[Case], entry_point: str | None, starter_code: str | None) -> list[_Run]:
    """The programs that decide one row's cases: all call cases in one, each other case in its own."""
    runs: list[_Run] = []
    calls = [i for i, case in enumerate(cases) if isinstance(case, CallCase)]
    if calls:
        call_cases = [cases[i] for i in calls]
        runs.append(_Run(Program(code, harness=calls_request(entry_point, call_cases)), calls,
                         lambda result, cs=call_cases: judge_calls(result, cs)))
    for i, case in enumerate(cases):
        if isinstance(case, StdioCase):
            runs.append(_Run(Program(code, stdin=case.stdin), [i], lambda result, c=case: [judge_stdio(result, c)]))
        elif isinstance(case, AssertCase):
            nonce = new_nonce()
            runs.append(_Run(Program(code, harness=asserts_request(case, nonce, entry_point, starter_code)), [i],
                             lambda result, n=nonce: [judge_asserts(result, n)]))
    return runs


def _refuse_asserts(cases: list[Case], row: int | None) -> None:
    where = f"row {row}: " if row is not None else ""
    for k, case in enumerate(cases):
        if isinstance(case, AssertCase):
            raise ValueError(f"code reward: {where}case {k} {ASSERTS_REFUSED}")


def _score(completions: list[str], tests: list, entry_point: list | None, starter_code: list | None,
           partial_credit: bool, sandbox: SandboxConfig | None, asserts: bool, name: str) -> list[float | None]:
    """Both rewards (module doc); ``asserts``: whether test code may run."""
    n = len(completions)
    for what, values in (("tests", tests), ("entry_point", entry_point), ("starter_code", starter_code)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} reward: got {n} completions but {len(values)} {what} values; expected one "
                             f"per completion")
    names = entry_point if entry_point is not None else [None] * n
    starters = starter_code if starter_code is not None else [None] * n
    rows = [parse_tests(t, row, entry_point=names[row]) for row, t in enumerate(tests)]
    if not asserts:
        for row, cases in enumerate(rows):
            _refuse_asserts(cases, row)
    runs: list[_Run] = []
    owner: list[int] = []
    for row, (completion, cases) in enumerate(zip(completions, rows)):
        code = assemble_program(extract_program(completion, names[row]), names[row], starters[row])
        row_runs = _row_runs(code, cases, names[row], starters[row])
        runs += row_runs
        owner += [row] * len(row_runs)
    verdicts = run_programs([r.program for r in runs], sandbox or DEFAULT_SANDBOX,
                            map_result=lambda index, result: runs[index].judge(result))
    per_row: list[list[Verdict]] = [[False] * len(cases) for cases in rows]
    for run, row, run_verdicts in zip(runs, owner, verdicts):
        for case, verdict in zip(run.cases, run_verdicts):
            per_row[row][case] = verdict
    scores: list[float | None] = []
    for row, row_verdicts in enumerate(per_row):
        infra = [v for v in row_verdicts if isinstance(v, str)]
        if infra:
            logger.warning("%s reward: row %d not scored, the sandbox failed: %s", name, row, infra[0])
            scores.append(None)
            continue
        passed = sum(row_verdicts)
        scores.append(passed / len(row_verdicts) if partial_credit else float(passed == len(row_verdicts)))
    return scores


def code_reward(completions: list[str], tests: list, *, entry_point: list | None = None,
                starter_code: list | None = None, partial_credit: bool = False, sandbox: SandboxConfig | None = None,
                **kwargs: Any) -> list[float | None]:
    """The ``code`` reward: call and stdin/stdout cases, judged outside the program's process (module doc).

    Args:
        completions: N completions (EOS stripped).
        tests: N ``tests`` values (``sandbox.cases``), row-aligned with completions.
        entry_point, starter_code: N values of the rows' function name and starter code (None, or None items, for
            rows without them).
        partial_credit: score the fraction of cases passed instead of all-or-nothing.
        sandbox: limits and mode; None = ``sandbox.DEFAULT_SANDBOX``.
        **kwargs: the other dataset columns and ``prompts`` (TRL's convention); ignored.

    Returns:
        N scores in [0, 1], None for a row whose check hit an infrastructure failure.

    Raises:
        ValueError: a length mismatch, a row without (well-formed) tests, or a row with test code (``code_asserts``
            runs it).
    """
    return _score(completions, tests, entry_point, starter_code, partial_credit, sandbox, False, "code")


def code_asserts_reward(completions: list[str], tests: list, *, entry_point: list | None = None,
                        starter_code: list | None = None, partial_credit: bool = False,
                        sandbox: SandboxConfig | None = None, **kwargs: Any) -> list[float | None]:
    """The ``code_asserts`` reward: :func:`code_reward` that also runs test code, in the program's own process after
    it (module doc; docs/sandbox.md says what that style does not catch). Arguments as :func:`code_reward`.

    Raises:
        ValueError: a length mismatch, or a row without (well-formed) tests.
    """
    return _score(completions, tests, entry_point, starter_code, partial_credit, sandbox, True, "code_asserts")


def check_code_row(tests: Any, entry_point: str | None = None, **columns: Any) -> None:
    """``code``'s row check (``grpo.rewards.checks``), when the data is loaded: well-formed tests, no test code.

    Raises:
        ValueError: why the row cannot be scored.
    """
    _refuse_asserts(parse_tests(tests, entry_point=entry_point), None)


def check_code_asserts_row(tests: Any, entry_point: str | None = None, **columns: Any) -> None:
    """``code_asserts``'s row check: well-formed tests of any style.

    Raises:
        ValueError: why the row cannot be scored.
    """
    parse_tests(tests, entry_point=entry_point)


code_reward.check_row = check_code_row
code_asserts_reward.check_row = check_code_asserts_row
