"""The ``code`` reward: run a completion's Python program against the row's tests in the sandbox.

    REWARD_FUNCTIONS["code"](completions=["```python\\ndef add(a, b):\\n    return a + b\\n```"],
                             tests=["assert add(2, 3) == 5"])  # [1.0]

Contract. The reward reads the row's ``tests`` column; the program passes when it exits 0 within the sandbox's
limits (``grpo.rewards.sandbox``). What a row's ``tests`` may be:

- a str: Python test code, run after the completion's code in the same program (stdin empty). One case.
- a list whose items are cases, each one of
    - a str: a test snippet, run after the completion's code in a program of its own;
    - a dict ``{"input": str, "output": str}``: the completion's code alone, with ``input`` on stdin; the case passes
      when the program passes and its stdout equals ``output`` once each line's trailing whitespace and the trailing
      empty lines are dropped (leading whitespace and inner empty lines count).
- a dict ``{"inputs": [str, ...], "outputs": [str, ...]}`` (the APPS/TACO layout): the stdin/stdout cases zipped.

Score: 1.0 when every case passes, else 0.0; with ``partial_credit=True`` the fraction of cases that pass. None
("no score") when any case of the row hit an infrastructure failure (``SandboxResult.status == "infra_error"``):
the sandbox, not the policy, failed, and a 0 would train on it; the caller excludes such rows and counts them. A row
without tests (None, "", [], {}) or with a malformed case raises ValueError naming the row: bad data, not a policy
failure.

Program extraction (:func:`extract_program`): the last fenced block tagged ``python``/``py``/``python3`` (an
unclosed last fence runs to the end of the completion: a truncated answer), else the last untagged fenced block,
else the whole completion. For a row with an ``entry_point`` (below), the last such block that defines it comes
first: a usage example written after the function is not the program.

Function-completion rows (HumanEval, APPS/LiveCodeBench call-based problems) may also carry ``starter_code`` (the
code the prompt shows: imports, helpers, the function's signature and docstring) and ``entry_point`` (the function's
name). Then the program run is the starter code followed by the extracted program (:func:`assemble_program`): when
the extracted program defines ``entry_point`` at top level (``def``/``async def``/an assignment), it is appended
after the starter code (its definition replaces the stub, and the starter code's imports and helpers stay
available); otherwise it is taken as the function's body and appended directly, continuing the signature. Rows
without ``starter_code`` run the extracted program alone.

What a program can do to win (measured, not prevented): exit 0 before the tests run (``exit(0)``, ``os._exit(0)``)
passes test-code rows, since the tests run in its own process. Stdin/stdout rows compare output and are not open to
that. Datasets whose rows are test code should prefer stdin/stdout cases where reward hacking matters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grpo.rewards.sandbox import Program, SandboxConfig, SandboxResult, run_programs

__all__ = ["DEFAULT_SANDBOX", "assemble_program", "code_reward", "defines_name", "extract_program", "normalize_output",
           "parse_tests"]

logger = logging.getLogger(__name__)

#: The sandbox config the reward uses when none is passed.
DEFAULT_SANDBOX = SandboxConfig()

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$", re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_program(completion: str, entry_point: str | None = None) -> str:
    """The Python program in a completion (rules in the module doc). Fences pair up in order (an opening line
    "```tag", then a closing line "```"), as in Markdown. With ``entry_point``, the last block (tagged first, then
    untagged) that defines it is preferred, so a usage example written after the function is not taken for it.
    Never raises for a str."""
    fences = list(_FENCE.finditer(completion))
    tagged: list[str] = []
    untagged: list[str] = []
    for i in range(0, len(fences), 2):
        opening = fences[i]
        closing = fences[i + 1] if i + 1 < len(fences) else None
        body = completion[opening.end():closing.start() if closing else len(completion)].removeprefix("\n")
        tag = opening.group(1).lower()
        if tag in _PYTHON_TAGS:
            tagged.append(body)
        elif not tag and closing is not None:
            untagged.append(body)
    if entry_point:
        defining = [b for b in tagged if defines_name(b, entry_point)] or [
            b for b in untagged if defines_name(b, entry_point)]
        if defining:
            return defining[-1]
    if tagged:
        return tagged[-1]
    return untagged[-1] if untagged else completion


def defines_name(program: str, name: str) -> bool:
    """Whether ``program`` binds ``name`` at top level: a line starting ``def name(``, ``async def name(`` or
    ``name =`` in column 0 (a textual check: it does not parse the program, which may be truncated)."""
    pattern = rf"^(?:(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(|{re.escape(name)}[ \t]*=[^=])"
    return re.search(pattern, program, re.MULTILINE) is not None


def assemble_program(program: str, entry_point: str | None = None, starter_code: str | None = None) -> str:
    """The program a function-completion row runs (module doc): ``starter_code`` then ``program``, separated by blank
    lines when ``program`` defines ``entry_point``, joined directly (a body continuing the signature) when it does
    not; ``program`` unchanged when ``starter_code`` is None or empty."""
    if not starter_code:
        return program
    if entry_point and defines_name(program, entry_point):
        return starter_code.rstrip("\n") + "\n\n\n" + program
    return starter_code if not program.strip() else (
        starter_code + ("" if starter_code.endswith("\n") else "\n") + program)


def normalize_output(text: str) -> str:
    """Each line without trailing whitespace, trailing empty lines dropped (for stdin/stdout comparison)."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def parse_tests(tests: Any, row: int) -> list[str | tuple[str, str]]:
    """A row's ``tests`` value as a list of cases: a str is test code, a (stdin, expected stdout) pair an I/O case.

    Raises:
        ValueError: no tests, or a case of another shape; the message names the row (0-based) and what was found.
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"code reward: row {row}: {what}; expected Python test code (str), a list of test snippets "
                          f"or of {{'input': str, 'output': str}} cases, or {{'inputs': [...], 'outputs': [...]}}")

    if tests is None or (isinstance(tests, (str, Sequence, Mapping)) and len(tests) == 0):
        raise bad(f"has no tests ({tests!r})")
    if isinstance(tests, str):
        return [tests]
    if isinstance(tests, Mapping):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not (isinstance(inputs, Sequence) and isinstance(outputs, Sequence)) or len(inputs) != len(outputs):
            raise bad(f"a dict of tests needs equal-length 'inputs' and 'outputs' lists, got keys {sorted(tests)}")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(tests, Sequence):
        raise bad(f"tests of type {type(tests).__name__}")
    cases: list[str | tuple[str, str]] = []
    for k, case in enumerate(tests):
        if isinstance(case, str) and case.strip():
            cases.append(case)
        elif isinstance(case, Mapping) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str):
            cases.append((case["input"], case["output"]))
        else:
            raise bad(f"case {k} is {case!r:.80}")
    return cases


def _case_program(code: str, case: str | tuple[str, str]) -> Program:
    if isinstance(case, str):
        return Program(code + "\n\n" + case + "\n")
    return Program(code, stdin=case[0])


def _case_verdict(case: str | tuple[str, str], result: SandboxResult) -> bool | str:
    """True/False for a case that ran, or the infrastructure error's detail (a str: no verdict)."""
    if result.infra_error:
        return result.detail or "infra_error"
    if not result.passed:
        return False
    return isinstance(case, str) or normalize_output(result.stdout) == normalize_output(case[1])


def code_reward(completions: list[str], tests: list, *, entry_point: list | None = None,
                starter_code: list | None = None, partial_credit: bool = False, sandbox: SandboxConfig | None = None,
                **kwargs: Any) -> list[float | None]:
    """Score each completion's program against its row's tests (contract in the module doc).

    Args:
        completions: N completions (EOS stripped).
        tests: N ``tests`` values, row-aligned with completions.
        entry_point, starter_code: N values of the rows' function name and starter code (None, or None items, for
            rows without them): the program is :func:`assemble_program` of the one :func:`extract_program` finds
            for the entry point.
        partial_credit: score the fraction of cases passed instead of all-or-nothing.
        sandbox: limits and mode; None = :data:`DEFAULT_SANDBOX`. Every case of the batch runs in one
            ``run_programs`` call, ``sandbox.parallel`` at a time; each output is dropped once its case is judged.
        **kwargs: the other dataset columns and ``prompts`` (TRL's convention); ignored.

    Returns:
        N scores in [0, 1], None for a row whose check hit an infrastructure failure.

    Raises:
        ValueError: len(tests) != len(completions), or a row without (well-formed) tests.
    """
    if len(tests) != len(completions):
        raise ValueError(f"code reward: got {len(completions)} completions but {len(tests)} tests values; expected "
                         f"one tests value per completion")
    for name, values in (("entry_point", entry_point), ("starter_code", starter_code)):
        if values is not None and len(values) != len(completions):
            raise ValueError(f"code reward: got {len(completions)} completions but {len(values)} {name} values; "
                             f"expected one per completion")
    rows = [parse_tests(t, row) for row, t in enumerate(tests)]
    cases = [case for row_cases in rows for case in row_cases]
    names = entry_point if entry_point is not None else [None] * len(completions)
    starters = starter_code if starter_code is not None else [None] * len(completions)
    codes = [assemble_program(extract_program(completion, name), name, starter)
             for completion, name, starter in zip(completions, names, starters)]
    programs = [_case_program(code, case) for code, row_cases in zip(codes, rows) for case in row_cases]
    verdicts = run_programs(programs, sandbox or DEFAULT_SANDBOX,
                            map_result=lambda index, result: _case_verdict(cases[index], result))
    scores: list[float | None] = []
    start = 0
    for row, row_cases in enumerate(rows):
        row_verdicts = verdicts[start:start + len(row_cases)]
        start += len(row_cases)
        infra = [v for v in row_verdicts if isinstance(v, str)]
        if infra:
            logger.warning("code reward: row %d not scored, the sandbox failed: %s", row, infra[0])
            scores.append(None)
            continue
        passed = sum(row_verdicts)
        scores.append(passed / len(row_cases) if partial_credit else float(passed == len(row_cases)))
    return scores
