"""The judge, outside the sandbox: what a program under test is asked (the harness's request) and whether the evidence
it left says that every test ran and passed.

The judge runs in the reward's own process, a separate process from the program's, and reads only plain data: the
harness's frames (``sandbox.harness``) as JSON, decoded into Python's own builtins, and the program's stdout as text.
Expected values never enter the sandbox. What the program can do to that evidence decides nothing by itself:

- **call cases**: a case passes when its frame holds a value that passes the case's check against the expected
  value (:func:`value_passes`), and the row's program ended cleanly: a frame for every call, in order, then the
  ``done`` frame, the process's exit status 0 within every limit. A stream with anything else in it (a frame the
  program wrote itself, a duplicate, a line that is not a frame) fails every case of the program;
- **stdin/stdout cases**: exit 0 within every limit and the stdout as expected (:func:`normalize_output`);
- **test code** (``asserts`` style): the frame ``{"passed": NONCE}`` with this program's own nonce, and nothing else,
  and exit 0 within every limit. The nonce is fresh for each program (``secrets.token_hex``), so no exit, no printed
  marker and no frame the program writes without it counts.

A verdict is True/False per case, or a str, the detail of an infrastructure failure (``infra_error``: no verdict).
"""

from __future__ import annotations

import json
import marshal
import secrets
from pathlib import Path

from sandbox import harness
from sandbox.cases import AssertCase, CallCase, StdioCase
from sandbox.config import SandboxResult

__all__ = ["Verdict", "asserts_request", "calls_request", "harness_input", "judge_asserts", "judge_calls",
           "judge_stdio", "new_nonce", "normalize_output", "parse_frames", "value_passes"]

#: True/False: the case failed or passed; a str: the sandbox failed (its detail), no verdict.
Verdict = bool | str

_HARNESS_TEXT = Path(harness.__file__).read_bytes()


def harness_input(request: dict) -> bytes:
    """What the harness pipe carries (``sandbox.bootstrap``): ``sandbox/harness.py``'s text, a NUL byte, the request
    (``marshal`` version 2: plain data, no shared references, read by any Python 3)."""
    return _HARNESS_TEXT + b"\0" + marshal.dumps(request, 2)


def calls_request(entry_point: str, cases: list[CallCase]) -> bytes:
    """The harness input that calls ``entry_point`` once per case: arguments only, never the expected values."""
    calls = [(tuple(c.args), dict(c.kwargs), c.apply) for c in cases]
    return harness_input({"style": "calls", "entry_point": entry_point, "calls": calls})


def new_nonce() -> str:
    """A fresh secret for one program's ``asserts`` run (128 bits)."""
    return secrets.token_hex(16)


def asserts_request(case: AssertCase, nonce: str, entry_point: str | None, starter_code: str | None) -> bytes:
    """The harness input that runs ``case``'s test code after the program (``sandbox.harness``, ``asserts``)."""
    return harness_input({"style": "asserts", "tests": case.code, "nonce": nonce, "entry_point": entry_point,
                          "setup": starter_code or ""})


def parse_frames(results: bytes) -> list[dict] | None:
    """The harness's frames (one JSON object a line, the last line ended), or None when the stream is anything else."""
    if not results.endswith(b"\n"):
        return None
    frames = []
    for line in results[:-1].split(b"\n"):
        try:
            frame = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if type(frame) is not dict:
            return None
        frames.append(frame)
    return frames


def value_passes(case: CallCase, value: object) -> bool:
    """Whether a call's result (plain data, decoded by the judge) passes the case's check (``sandbox.cases``)."""
    try:
        if case.check == "eq":
            return bool(value == case.expected)
        if case.check == "is":
            return type(value) is type(case.expected) and bool(value == case.expected)
        if case.check == "close":
            numeric = isinstance(value, (int, float))
            return numeric and bool(abs(value - case.expected) < case.tolerance)
        return bool(value) is (case.check == "truthy")
    except (ArithmeticError, RecursionError, TypeError, ValueError):
        return False


def judge_calls(result: SandboxResult, cases: list[CallCase]) -> list[Verdict]:
    """One verdict per call case of one program's run (module doc)."""
    if result.infra_error:
        return [result.detail or "infra_error"] * len(cases)
    frames = parse_frames(result.results)
    expected_frames = len(cases) + 1
    if not result.passed or frames is None or len(frames) != expected_frames or frames[-1] != {"done": len(cases)}:
        return [False] * len(cases)
    verdicts: list[Verdict] = []
    for index, (case, frame) in enumerate(zip(cases, frames)):
        if frame.get("case") != index or set(frame) not in ({"case", "value"}, {"case", "error"}):
            return [False] * len(cases)
        if "error" in frame:
            verdicts.append(False)
            continue
        try:
            value = harness.decode(frame["value"])
        except (ValueError, RecursionError):
            return [False] * len(cases)
        verdicts.append(value_passes(case, value))
    return verdicts


def judge_asserts(result: SandboxResult, nonce: str) -> Verdict:
    """The verdict of one ``asserts`` run: passed only on this program's nonce frame and a clean end."""
    if result.infra_error:
        return result.detail or "infra_error"
    return result.passed and parse_frames(result.results) == [{"passed": nonce}]


def normalize_output(text: str) -> str:
    """Each line without trailing whitespace, trailing empty lines dropped (for stdin/stdout comparison)."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def judge_stdio(result: SandboxResult, case: StdioCase) -> Verdict:
    """The verdict of one stdin/stdout run: exit 0 within the limits and the expected output."""
    if result.infra_error:
        return result.detail or "infra_error"
    return result.passed and normalize_output(result.stdout) == normalize_output(case.stdout)
