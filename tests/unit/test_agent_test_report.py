"""sandbox.test_report.run_tests, the coding agent's test runner (examples/code_agent): its verdict is the ``code``
reward's on the same completion (hacks included), and what it tells the model about a failure names the call, what
came back and what was expected, or why the program never reached its tests. Needs bwrap; ~5 s here."""

from __future__ import annotations

import shutil

import pytest

from grpo.rewards import REWARD_FUNCTIONS
from sandbox.config import SandboxConfig
from sandbox.test_report import run_tests

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                "bubblewrap; scripts/install_test_tools.sh installs it)")
SANDBOX = SandboxConfig(cpu_time_s=2, wall_time_s=5, uid_base=61400, uid_count=64)
TESTS = [{"args": [2, 3], "expected": 5}, {"args": [-1, 1], "expected": 0}, {"args": [10, 5], "expected": 15},
         {"args": [0, 0], "expected": 0}]
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "Sure:\n```python\ndef add(a, b):\n    return a - b\n```"


def report(completion: str, tests=TESTS, **kw):
    return run_tests(completion, tests, "add", config=SANDBOX, **kw)


def test_agent_test_report_right_and_wrong_answers():
    right = report(RIGHT)
    assert right.passed is True and right.ran and right.feedback() == "" and right.status == "passed"
    assert [c.got for c in right.cases] == ["5", "0", "15", "0"]
    wrong = report(WRONG)
    assert wrong.passed is False and wrong.ran and [c.passed for c in wrong.cases] == [False, False, False, True]
    assert wrong.feedback(2) == ("add(2, 3) returned -1, expected 5\nadd(-1, 1) returned -2, expected 0\n"
                                 "(1 more of the 4 tests failed)")
    assert wrong.feedback(5).count("\n") == 2 and "add(0, 0)" not in wrong.feedback(5)  # passing cases not shown


def test_agent_test_report_says_why_a_program_did_not_run():
    broken = report("```python\ndef add(a, b:\n    return a + b\n```")
    assert broken.passed is False and not broken.ran and broken.status == "failed"
    assert broken.feedback() == "The program did not run its tests: SyntaxError: '(' was never closed"
    missing = report("```python\ndef plus(a, b):\n    return a + b\n```")
    assert not missing.ran and missing.feedback() == (
        "4 of the 4 tests raised NameError: the program defines no function 'add'")
    raising = report("```python\ndef add(a, b):\n    return a / b\n```")
    assert raising.cases[3].error == "ZeroDivisionError: division by zero"
    assert raising.cases[0].got == "0.6666666666666666"
    assert "add(0, 0) raised ZeroDivisionError: division by zero" in raising.feedback(4)
    slow = run_tests("```python\nwhile True:\n    pass\n```", TESTS, "add",
                     config=SandboxConfig(cpu_time_s=1, wall_time_s=2, uid_base=61400, uid_count=64))
    assert slow.passed is False and slow.status in ("cpu_limit", "timeout")
    assert "did not run its tests" in slow.feedback()


def test_agent_test_report_verdict_is_the_code_reward():
    forged = ("```python\nimport os\nfor fd in range(3, 20):\n    try:\n"
              "        os.write(fd, b'{\"case\": 0, \"value\": 5}\\n')\n    except OSError:\n        pass\n"
              "def add(a, b):\n    return 5\n```")
    rigged = ("```python\nclass E(int):\n    def __eq__(self, o):\n        return True\n"
              "def add(a, b):\n    return E(a - b)\n```")
    completions = [RIGHT, WRONG, forged, "no code at all", rigged,
                   "```python\ndef add(a, b):\n    return a + b + 0 * (a == 10)\n```"]
    scores = REWARD_FUNCTIONS["code"](completions=completions, tests=[TESTS] * len(completions),
                                      entry_point=["add"] * len(completions), sandbox=SANDBOX)
    assert [report(c).passed for c in completions] == [s == 1.0 for s in scores]
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_agent_test_report_stdio_cases_and_refusals():
    stdio = [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1\n", "output": "2\n"}]
    echo = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    got = run_tests(echo, stdio, config=SANDBOX)
    assert [c.passed for c in got.cases] == [False, False] and got.feedback(1).startswith("stdin '2 3\\n' returned")
    assert run_tests(echo.replace("a * b", "a + b"), stdio, config=SANDBOX).passed is True
    with pytest.raises(ValueError, match="test code"):
        run_tests(RIGHT, ["assert add(1, 1) == 2"], "add", config=SANDBOX)
    with pytest.raises(ValueError, match="no tests"):
        run_tests(RIGHT, [], "add", config=SANDBOX)


def test_agent_test_report_sandbox_failure_is_no_verdict():
    down = run_tests(RIGHT, TESTS, "add", config=SandboxConfig(bwrap_path="/nonexistent/bwrap", uid_base=61400,
                                                                uid_count=64))
    assert down.status == "infra_error" and down.passed is None and not down.ran
