"""grpo.rewards.code: the ``code`` reward (program extraction, the ``tests`` forms, scores, None for infrastructure
failures). The end-to-end tests need bwrap (Debian package ``bubblewrap``) and skip without it. ~3 s here."""

from __future__ import annotations

import shutil

import pytest

from grpo.rewards import REWARD_FUNCTIONS, RewardFunctionName
from grpo.rewards.code import code_reward, extract_program, normalize_output, parse_tests
from grpo.rewards.sandbox import SandboxConfig

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                 "bubblewrap; scripts/install_test_tools.sh installs it)")
SANDBOX = SandboxConfig(cpu_time_s=2, wall_time_s=5, uid_base=61100, uid_count=64)
ADD = "```python\ndef add(a, b):\n    return a + b\n```\n"
SUB = "Here is my answer:\n```python\ndef add(a, b):\n    return a - b\n```\nDone."
ECHO_SUM = "```python\nimport sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n```"


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
    assert parse_tests("assert f()", 0) == ["assert f()"]
    assert parse_tests(["assert a", {"input": "1", "output": "2"}], 0) == ["assert a", ("1", "2")]
    assert parse_tests({"inputs": ["1", "2"], "outputs": ["3", "4"]}, 0) == [("1", "3"), ("2", "4")]
    for empty in (None, "", [], {}):
        with pytest.raises(ValueError, match="row 4: has no tests"):
            parse_tests(empty, 4)
    with pytest.raises(ValueError, match="row 2: case 1 is"):
        parse_tests(["assert a", {"input": "1"}], 2)
    with pytest.raises(ValueError, match="row 0: a dict of tests needs equal-length"):
        parse_tests({"inputs": ["1"], "outputs": []}, 0)
    with pytest.raises(ValueError, match="row 1: tests of type int"):
        parse_tests(7, 1)


def test_sandbox_code_registered_and_rows_checked_before_running():
    assert "code" in REWARD_FUNCTIONS and "code" in RewardFunctionName.__args__
    assert REWARD_FUNCTIONS["code"] is code_reward
    with pytest.raises(ValueError, match="row 1: has no tests"):  # raised before anything runs
        REWARD_FUNCTIONS["code"](completions=[ADD, ADD], tests=["assert add(1, 1) == 2", None])
    with pytest.raises(ValueError, match="2 completions but 1 tests"):
        code_reward(completions=[ADD, ADD], tests=["assert True"])


@needs_bwrap
def test_sandbox_code_test_code_rows():
    scores = REWARD_FUNCTIONS["code"](
        completions=[ADD, SUB, "no code at all", ADD.replace("```\n", "exit(3)\n```")],
        tests=["assert add(2, 3) == 5"] * 4,
        prompts=["p"] * 4, answer=["ignored"] * 4, sandbox=SANDBOX)  # other columns pass through **kwargs
    assert scores == [1.0, 0.0, 0.0, 0.0]


@needs_bwrap
def test_sandbox_code_stdin_stdout_cases():
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5\n5\n", "output": "10   \n\n"},
             {"input": "0\n", "output": "1\n"}]
    assert code_reward([ECHO_SUM], [cases], sandbox=SANDBOX) == [0.0]
    assert code_reward([ECHO_SUM], [cases[:2]], sandbox=SANDBOX) == [1.0]
    apps = {"inputs": ["2 2\n", "3 4\n"], "outputs": ["4\n", "7\n"]}
    assert code_reward([ECHO_SUM], [apps], sandbox=SANDBOX) == [1.0]
    # exit 0 is not enough where the output is compared
    assert code_reward(["```python\nimport os\nos._exit(0)\n```"], [cases[:1]], sandbox=SANDBOX) == [0.0]


@needs_bwrap
def test_sandbox_code_partial_credit():
    snippets = ["assert add(1, 1) == 2", "assert add(0, 0) == 0", "assert add(2, 3) == 6", "assert add(-1, 1) == 0"]
    assert code_reward([SUB, ADD], [snippets, snippets], partial_credit=True, sandbox=SANDBOX) == [0.25, 0.75]
    assert code_reward([SUB, ADD], [snippets, snippets], sandbox=SANDBOX) == [0.0, 0.0]
    io = [{"input": "1\n", "output": "1\n"}, {"input": "1 1\n", "output": "3\n"}]
    assert code_reward([ECHO_SUM], [io], partial_credit=True, sandbox=SANDBOX) == [0.5]


@needs_bwrap
def test_sandbox_code_limits_score_zero():
    loop = "```python\nwhile True:\n    pass\n```"
    config = SandboxConfig(cpu_time_s=1, wall_time_s=3, uid_base=61100, uid_count=64)
    assert code_reward([loop], ["assert True"], sandbox=config) == [0.0]


def test_sandbox_code_infra_failure_is_none_not_zero(tmp_path):
    broken = SandboxConfig(bwrap_path=str(tmp_path / "missing-bwrap"), uid_base=61100, uid_count=64)
    scores = code_reward([ADD, SUB], ["assert add(2, 3) == 5", ["assert add(1, 1) == 2"]], sandbox=broken)
    assert scores == [None, None]
    assert code_reward([ADD], ["assert add(2, 3) == 5"], partial_credit=True, sandbox=broken) == [None]
