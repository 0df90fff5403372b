"""Run a completion's program against a row's tests in the sandbox and say what happened, case by case: what an
agent that lets the model fix its code needs (``examples/code_agent``), beside the ``code`` reward's single score.

    report = run_tests(completion, row["tests"], row["entry_point"])
    report.passed               # True / False, None when the sandbox could not run it (no verdict)
    report.feedback(2)          # "add_number(3) returned 9, expected 10\\n..." for the model

The verdicts are the ``code`` reward's: the same program (:func:`sandbox.programs.extract_program` and
:func:`sandbox.programs.assemble_program`), the same harness and judge (:func:`sandbox.judge.judge_calls`,
:func:`sandbox.judge.judge_stdio`), so ``report.passed`` is True exactly when ``code`` would pay 1.0. What a call
returned or raised is read from the harness's frames only to describe a failure, never to decide one. Call cases and
stdin/stdout cases only: test code runs inside the program's process (docs/sandbox.md) and is refused, as by
``code``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandbox import harness
from sandbox.cases import AssertCase, CallCase, Case, StdioCase, parse_tests
from sandbox.code_reward import ASSERTS_REFUSED
from sandbox.config import DEFAULT_SANDBOX, Program, SandboxConfig, SandboxResult, SandboxStatus
from sandbox.judge import calls_request, judge_calls, judge_stdio, parse_frames
from sandbox.programs import assemble_program, extract_program
from sandbox.runner import run_program

__all__ = ["CaseOutcome", "TestReport", "run_tests"]

#: Characters of one value, call or cause shown in a failure's line.
SHOWN_CHARS = 120


def _short(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class CaseOutcome:
    """One test case's verdict and what the program did.

    Attributes:
        call: the case as text: ``add_number(3)``, or ``stdin '2 3'``.
        passed: the judge's verdict.
        expected: the expected value (``repr``) or output.
        got: what the call returned (``repr``) or the program printed; None when it raised or did not run.
        error: ``"Type: message"`` of what the call raised; None otherwise.
    """

    call: str
    passed: bool
    expected: str
    got: str | None = None
    error: str | None = None

    def line(self) -> str:
        """One line saying how the case went."""
        if self.passed:
            return f"{self.call} returned {self.got}, as expected"
        if self.error is not None:
            return f"{self.call} raised {_short(self.error)}"
        if self.got is None:
            return f"{self.call} did not run"
        return f"{self.call} returned {_short(self.got)}, expected {_short(self.expected)}"


@dataclass(frozen=True)
class TestReport:
    """The program's run against a row's tests.

    Attributes:
        status: the sandbox status of the program's (last) run (``sandbox.config.SandboxStatus``).
        cases: one :class:`CaseOutcome` per test case, in the row's order.
        cause: why the program did not reach its tests: stderr's last line (``SyntaxError: ...``) or the limit it
            hit; "" when it reached them.
    """

    __test__ = False  # not a pytest test class, whatever its name

    status: SandboxStatus
    cases: tuple[CaseOutcome, ...]
    cause: str = ""

    @property
    def passed(self) -> bool | None:
        """Every case passed (the ``code`` reward's 1.0); None when the sandbox failed (``infra_error``)."""
        if self.status == "infra_error":
            return None
        return all(c.passed for c in self.cases)

    @property
    def ran(self) -> bool:
        """The program ran without an error of its own: it reached its tests (compiled, ended within the limits)
        and every call returned a value (none raised), right or wrong."""
        return not self.cause and all(c.got is not None for c in self.cases)

    def feedback(self, max_cases: int = 2) -> str:
        """What went wrong, for the model: the cause when the program did not reach its tests, else one line per
        failed case (at most ``max_cases``, and how many more failed); "" when every case passed."""
        if self.passed:
            return ""
        if self.cause:
            return f"The program did not run its tests: {_short(self.cause)}"
        failed = [c for c in self.cases if not c.passed]
        errors = {c.error for c in failed}
        if len(failed) > 1 and len(errors) == 1 and None not in errors:
            return f"{len(failed)} of the {len(self.cases)} tests raised {_short(failed[0].error)}"
        lines = [c.line() for c in failed[:max_cases]]
        if len(failed) > max_cases:
            lines.append(f"({len(failed) - max_cases} more of the {len(self.cases)} tests failed)")
        return "\n".join(lines)


def _cause(result: SandboxResult) -> str:
    """Why a run did not finish its tests (module doc of ``sandbox.python_tool`` does the same for the tool)."""
    if result.status == "passed":
        return ""
    stderr = result.stderr.strip()
    last = stderr.splitlines()[-1].strip() if stderr else ""
    if result.status == "failed":
        return last or f"exit code {result.exit_code}"
    return f"{result.status} ({result.detail})" + (f": {last}" if last else "")


def _call_text(entry_point: str, case: CallCase) -> str:
    args = [repr(a) for a in case.args] + [f"{k}={v!r}" for k, v in case.kwargs.items()]
    return _short(f"{entry_point}({', '.join(args)})")


def _expected_text(case: CallCase) -> str:
    if case.check in ("truthy", "falsy"):
        return f"a {case.check} value"
    if case.check == "close":
        return f"{case.expected!r} (within {case.tolerance:g})"
    return repr(case.expected)


def _call_outcomes(result: SandboxResult, entry_point: str, cases: list[CallCase]) -> tuple[list[CaseOutcome], str]:
    """The call cases' outcomes (verdicts by the judge) and the cause when the program did not reach them."""
    verdicts = judge_calls(result, cases)
    frames = parse_frames(result.results) or []
    seen: dict[int, dict] = {f["case"]: f for f in frames if isinstance(f.get("case"), int)}
    outcomes = []
    for index, (case, verdict) in enumerate(zip(cases, verdicts)):
        frame = seen.get(index, {})
        got = error = None
        if "value" in frame:
            try:
                got = repr(harness.decode(frame["value"]))
            except (ValueError, RecursionError):
                got = "(a value that is not plain data)"
        elif isinstance(frame.get("error"), str):
            error = frame["error"]
        outcomes.append(CaseOutcome(_call_text(entry_point, case), verdict is True, _expected_text(case), got, error))
    reached = len(seen) == len(cases)
    return outcomes, "" if reached else _cause(result) or "the program ended before its tests finished"


def run_tests(completion: str, tests: Any, entry_point: str | None = None, *, starter_code: str | None = None,
              config: SandboxConfig | None = None) -> TestReport:
    """Run the program of ``completion`` against ``tests`` in the sandbox, one program for the call cases and one per
    stdin/stdout case (module doc). Blocking: an agent awaits it with ``asyncio.to_thread``.

    Args:
        completion: the model's reply (the program is its code block, as the ``code`` reward takes it).
        tests: the row's ``tests`` (``sandbox.cases``). entry_point, starter_code: the row's.
        config: limits and mode; None = ``sandbox.DEFAULT_SANDBOX``.

    Raises:
        ValueError: malformed tests, or test code (``code`` refuses it too).
    """
    cases: list[Case] = parse_tests(tests, entry_point=entry_point)
    for k, case in enumerate(cases):
        if isinstance(case, AssertCase):
            raise ValueError(f"run_tests: case {k} {ASSERTS_REFUSED}")
    config = config or DEFAULT_SANDBOX
    code = assemble_program(extract_program(completion, entry_point), entry_point, starter_code)
    outcomes: dict[int, CaseOutcome] = {}
    statuses: list[SandboxStatus] = []
    causes: list[str] = []
    calls = [i for i, c in enumerate(cases) if isinstance(c, CallCase)]
    if calls:
        result = run_program(Program(code, harness=calls_request(entry_point, [cases[i] for i in calls])),
                             config=config)
        found, cause = _call_outcomes(result, entry_point, [cases[i] for i in calls])
        outcomes.update(zip(calls, found))
        statuses.append(result.status)
        causes.append(cause)
    for i, case in enumerate(cases):
        if isinstance(case, StdioCase):
            result = run_program(Program(code, stdin=case.stdin), config=config)
            printed = repr(result.stdout) if result.status == "passed" else None
            outcomes[i] = CaseOutcome(_short(f"stdin {case.stdin!r}"), judge_stdio(result, case) is True,
                                      repr(case.stdout), printed)
            statuses.append(result.status)
            causes.append(_cause(result))
    return TestReport(_overall(statuses), tuple(outcomes[i] for i in range(len(cases))),
                      next((c for c in causes if c), ""))


def _overall(statuses: list[SandboxStatus]) -> SandboxStatus:
    """One status for several runs: ``infra_error`` if any, else the first that did not pass, else ``passed``."""
    if "infra_error" in statuses:
        return "infra_error"
    return next((s for s in statuses if s != "passed"), "passed")
