"""sandbox.code_reward: the ``code`` and ``code_asserts`` rewards (program extraction, the ``tests`` forms, the test
styles each accepts, scores, None for infrastructure failures), the wire format and the judge. The end-to-end tests
need bwrap (Debian package ``bubblewrap``) and skip without it; the reward hacks are in test_sandbox_hacks.py.
~5 s here."""

from __future__ import annotations

import json
import math
import shutil
from collections import OrderedDict

import pytest

from grpo.rewards import REWARD_FUNCTIONS, RewardFunctionName
from sandbox.cases import AssertCase, CallCase, StdioCase, parse_tests
from sandbox.code_reward import code_asserts_reward, code_reward
from sandbox.config import SandboxConfig, SandboxResult
from sandbox.harness import decode, encode, plain
from sandbox.judge import judge_calls, normalize_output, value_passes
from sandbox.programs import extract_program

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                 "bubblewrap; scripts/install_test_tools.sh installs it)")
SANDBOX = SandboxConfig(cpu_time_s=2, wall_time_s=5, uid_base=61100, uid_count=64)
ADD = "```python\ndef add(a, b):\n    return a + b\n```\n"
SUB = "Here is my answer:\n```python\ndef add(a, b):\n    return a - b\n```\nDone."
ECHO_SUM = "```python\nimport sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n```"
CALLS = [{"args": [2, 3], "expected": 5}, {"args": [-1, 1], "expected": 0}]


def test_sandbox_code_extract_program():
    two = "```python\nx = 1\n```\ntext\n```py\ny = 2\nprint(y)\n```\nend"
    assert extract_program(two) == "y = 2\nprint(y)\n"  # the last python block
    assert extract_program("prose\n```\nz = 3\n```\n") == "z = 3\n"  # untagged fallback
    assert extract_program("```python\ncut = 1\nprint(cu") == "cut = 1\nprint(cu"  # unclosed: to the end
    assert extract_program("print(5)") == "print(5)"  # no fence: the whole text
    assert extract_program("```bash\nls\n```\n```python\nok = 1\n```") == "ok = 1\n"
    assert extract_program("```\nopen\n") == "```\nopen\n"  # an unclosed untagged fence is not code


def test_sandbox_code_normalize_output():
    assert normalize_output("1 2  \n3\t\n\n\n") == "1 2\n3"
    assert normalize_output("  a\n\nb") == "  a\n\nb"  # leading spaces and inner empty lines count
    assert normalize_output("x\r\ny\r\n") == "x\ny"


def test_sandbox_code_parse_tests_forms_and_errors():
    assert parse_tests("assert f()", 0) == [AssertCase("assert f()")]
    assert parse_tests(["assert a", {"input": "1", "output": "2"}], 0) == [AssertCase("assert a"), StdioCase("1", "2")]
    assert parse_tests({"inputs": ["1", "2"], "outputs": ["3", "4"]}, 0) == [StdioCase("1", "3"), StdioCase("2", "4")]
    assert parse_tests([{"args": [(1, 2)], "expected": {1, 2}, "apply": "set"}], 0, entry_point="f") == [
        CallCase(((1, 2),), {}, {1, 2}, "eq", None, "set")]
    for empty in (None, "", [], {}):
        with pytest.raises(ValueError, match="row 4: has no tests"):
            parse_tests(empty, 4)
    with pytest.raises(ValueError, match="row 2: case 1 is"):
        parse_tests(["assert a", {"input": "1"}], 2)
    with pytest.raises(ValueError, match="row 0: a dict of tests needs equal-length"):
        parse_tests({"inputs": ["1"], "outputs": []}, 0)
    with pytest.raises(ValueError, match="row 1: tests of type int"):
        parse_tests(7, 1)
    bad_calls = [({"args": [1]}, "f", "check 'eq' needs an expected value"),
                 ({"args": [1], "expected": 1}, None, "calls the row's entry_point"),
                 ({"args": 1, "expected": 1}, "f", "args must be a list"),
                 ({"args": [1], "expected": 1, "check": "lt"}, "f", "check must be one of"),
                 ({"args": [1], "expected": 1, "check": "is"}, "f", "True, False or None"),
                 ({"args": [1], "expected": 1.0, "check": "close"}, "f", "tolerance > 0"),
                 ({"args": [1], "expected": True, "check": "truthy"}, "f", "takes no expected value"),
                 ({"args": [object()], "expected": 1}, "f", "args is not plain data"),
                 ({"args": [1], "expected": 1, "apply": "reversed"}, "f", "apply must be one of"),
                 ({"args": [1], "expected": 1, "oops": 2}, "f", "unknown key")]
    for case, entry_point, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            parse_tests([case], 3, entry_point=entry_point)


def test_sandbox_code_wire_format_round_trip_and_refusals():
    def round_trip(value):
        return decode(json.loads(encode(value)))

    value = [None, True, 3, -2.5, "é\udc80", b"\x00\xff", 1 + 2j, (1, [2]), {"k": (3,), 4: None}, {1, 2},
             frozenset({(1, 2)}), 2 ** 20_000, float("inf"), -float("inf"), 1e-300, bytearray(b"ab")]
    assert round_trip(value) == value and round_trip(value) == plain(value)
    assert type(round_trip((1,))) is tuple and type(round_trip(bytearray(b"a"))) is bytes
    assert math.isnan(round_trip(float("nan")))

    class Rigged(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Lies(list):
        def __iter__(self):
            return iter([1, 2, 3])

    assert type(round_trip(Rigged(7))) is int and round_trip(Rigged(7)) == 7 and type(plain(Rigged(7))) is int
    assert round_trip(Lies([9])) == [9] and type(plain(Lies([9]))) is list  # read through list's own methods
    assert round_trip(OrderedDict(a=1)) == {"a": 1}
    with pytest.raises(TypeError, match="not plain data"):
        encode(object())
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="deeper than"):
        encode(loop)
    for bad in ({"a": 1, "b": 2}, {"pickle": []}, {"set": [[1]]}, {"tuple": 3}):
        with pytest.raises(ValueError, match="not the wire format"):
            decode(bad)


def test_sandbox_code_judge_value_checks_and_frames():
    eq = CallCase((1,), expected=(1, 2))
    assert value_passes(eq, (1, 2)) and not value_passes(eq, [1, 2])  # Python's ==: a list is not a tuple
    assert value_passes(CallCase((1,), expected=1), True)  # and True == 1, as the original assert has it
    assert value_passes(CallCase((1,), expected=True, check="is"), True)
    assert not value_passes(CallCase((1,), expected=True, check="is"), 1)
    close = CallCase((1,), expected=0.33, check="close", tolerance=1e-6)
    assert value_passes(close, 0.33 + 1e-7) and not value_passes(close, 0.34) and not value_passes(close, "0.33")
    assert value_passes(CallCase((1,), check="truthy"), [0]) and value_passes(CallCase((1,), check="falsy"), "")
    cases = [CallCase((1,), expected=2), CallCase((2,), expected=3)]

    def result(frames: bytes, status="passed") -> SandboxResult:
        return SandboxResult(status, 0 if status == "passed" else 1, "", "", 0.1, results=frames)

    good = b'{"case": 0, "value": 2}\n{"case": 1, "error": "E: x"}\n{"done": 2}\n'
    assert judge_calls(result(good), cases) == [True, False]
    assert judge_calls(result(good, "failed"), cases) == [False, False]  # no clean end, no pass
    assert judge_calls(result(good.replace(b'{"done": 2}\n', b"")), cases) == [False, False]
    assert judge_calls(result(b'{"case": 0, "value": 2}\n' + good), cases) == [False, False]  # a forged frame
    assert judge_calls(result(good + b"junk\n"), cases) == [False, False]
    assert judge_calls(SandboxResult("infra_error", None, "", "", 0.1, "no bwrap"), cases) == ["no bwrap"] * 2


def test_sandbox_code_registered_lazily_and_rows_checked_before_running():
    assert "code" in RewardFunctionName.__args__ and "code_asserts" in RewardFunctionName.__args__
    assert REWARD_FUNCTIONS["code"] is code_reward and REWARD_FUNCTIONS["code_asserts"] is code_asserts_reward
    with pytest.raises(ValueError, match="row 1: has no tests"):  # raised before anything runs
        REWARD_FUNCTIONS["code"](completions=[ADD, ADD], tests=[CALLS, None], entry_point=["add", "add"])
    with pytest.raises(ValueError, match="2 completions but 1 tests"):
        code_reward(completions=[ADD, ADD], tests=[CALLS])
    with pytest.raises(ValueError, match="row 0: case 0 is Python test code.*code_asserts"):
        code_reward([ADD], ["assert add(2, 3) == 5"])
    with pytest.raises(ValueError, match="case 1 is Python test code"):
        code_reward.check_row(tests=[{"input": "", "output": ""}, "assert True"])
    code_asserts_reward.check_row(tests=[{"input": "", "output": ""}, "assert True"])


@needs_bwrap
def test_sandbox_code_call_cases():
    scores = REWARD_FUNCTIONS["code"](
        completions=[ADD, SUB, "no code at all", ADD.replace("```\n", "exit(3)\n```")],
        tests=[CALLS] * 4, entry_point=["add"] * 4,
        prompts=["p"] * 4, answer=["ignored"] * 4, sandbox=SANDBOX)  # other columns pass through **kwargs
    assert scores == [1.0, 0.0, 0.0, 0.0]
    half = [CALLS[0], {"args": [1, 0], "expected": 1}]
    assert code_reward([SUB], [half], entry_point=["add"], partial_credit=True, sandbox=SANDBOX) == [0.5]
    pair = "```python\ndef f(n):\n    return [n, n + 1]\n```"
    tests = [{"args": [1], "expected": (1, 2), "apply": "tuple"}, {"args": [1], "expected": (1, 2)}]
    assert code_reward([pair], [tests], entry_point=["f"], partial_credit=True, sandbox=SANDBOX) == [0.5]


@needs_bwrap
def test_sandbox_code_test_code_rows_need_code_asserts():
    scores = code_asserts_reward(
        completions=[ADD, SUB, "no code at all"], tests=["assert add(2, 3) == 5"] * 3, sandbox=SANDBOX)
    assert scores == [1.0, 0.0, 0.0]
    mixed = [CALLS[0], "assert add(1, 1) == 2", {"input": "", "output": ""}]
    assert code_asserts_reward([ADD], [mixed], entry_point=["add"], sandbox=SANDBOX) == [1.0]


@needs_bwrap
def test_sandbox_code_stdin_stdout_cases():
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5\n5\n", "output": "10   \n\n"},
             {"input": "0\n", "output": "1\n"}]
    assert code_reward([ECHO_SUM], [cases], sandbox=SANDBOX) == [0.0]
    assert code_reward([ECHO_SUM], [cases[:2]], sandbox=SANDBOX) == [1.0]
    apps = {"inputs": ["2 2\n", "3 4\n"], "outputs": ["4\n", "7\n"]}
    assert code_reward([ECHO_SUM], [apps], sandbox=SANDBOX) == [1.0]
    io = [{"input": "1\n", "output": "1\n"}, {"input": "1 1\n", "output": "3\n"}]
    assert code_reward([ECHO_SUM], [io], partial_credit=True, sandbox=SANDBOX) == [0.5]


@needs_bwrap
def test_sandbox_code_partial_credit_of_test_code():
    snippets = ["assert add(1, 1) == 2", "assert add(0, 0) == 0", "assert add(2, 3) == 6", "assert add(-1, 1) == 0"]
    assert code_asserts_reward([SUB, ADD], [snippets, snippets], partial_credit=True, sandbox=SANDBOX) == [0.25, 0.75]
    assert code_asserts_reward([SUB, ADD], [snippets, snippets], sandbox=SANDBOX) == [0.0, 0.0]


@needs_bwrap
def test_sandbox_code_limits_score_zero():
    loop = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    config = SandboxConfig(cpu_time_s=1, wall_time_s=3, uid_base=61100, uid_count=64)
    assert code_reward([loop], [CALLS], entry_point=["add"], sandbox=config) == [0.0]


def test_sandbox_code_infra_failure_is_none_not_zero(tmp_path):
    broken = SandboxConfig(bwrap_path=str(tmp_path / "missing-bwrap"), uid_base=61100, uid_count=64)
    scores = code_reward([ADD, SUB], [CALLS, [{"input": "1", "output": "1"}]], entry_point=["add", "add"],
                         sandbox=broken)
    assert scores == [None, None]
    assert code_asserts_reward([ADD], ["assert add(2, 3) == 5"], partial_credit=True, sandbox=broken) == [None]


@needs_bwrap
def test_sandbox_code_test_styles_in_rlimits_mode():
    """The harness and the judge are the same in the weaker mode (an interpreter the per-slot uid can run)."""
    from tests.unit.test_sandbox import _rlimits_config

    config = _rlimits_config()
    tests = [*CALLS, {"input": "", "output": ""}, "assert add(1, 1) == 2"]
    assert code_asserts_reward([ADD, SUB], [tests, tests], entry_point=["add"] * 2, partial_credit=True,
                               sandbox=config) == [1.0, 0.25]
