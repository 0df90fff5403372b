"""The environments of multi-turn rollouts (``grpo.environments``): the registry, the calculator (arithmetic without
``eval``), tool-call parsing, the ``tools`` environment (errors the policy caused are observations, the sandbox
failing is an infrastructure failure), the sandboxed Python tool and the ``scripted`` environment."""

from __future__ import annotations

import pytest

from grpo.environments import (ENVIRONMENTS, EnvironmentInfraError, Observation, Turn, check_environment,
                               make_environment, register_environment)
from grpo.environments.calculator import CalculatorError, calculate
from grpo.environments.tool_calls import CallError, ToolCall, parse_tool_calls
from sandbox import check_sandbox
from sandbox.config import SandboxConfig


def turn(text: str, index: int = 1) -> Turn:
    return Turn(text=text, token_ids=(1, 2), index=index, finish_reason="stop")


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("expression, result", [
    ("1234 * 5678", "7006652"), ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("2 ** 10", "1024"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("12 × 3 ÷ 4", "9"), ("0.1 + 0.2", "0.3"), ("1e3 + 1", "1001")])
def test_multi_turn_calculator_evaluates_arithmetic(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('ls')", "function calls are not allowed"), ("x + 1", "names are not allowed"),
    ("(1).real", "unsupported Attribute"), ("[1, 2][0]", "unsupported Subscript"), ("1 < 2", "comparisons"),
    ("2 ^ 3", "write \\*\\*"), ("1 / 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("2 ** 100000", "exponent 100000 is too large"), ("9 ** 256 ** 2", "too large"),
    ("(10 ** 150) * (10 ** 150)", "more than 200 digits"), ("1e308 * 10", "not finite"), ("True + 1", "only numbers"),
    ("'a' * 3", "only numbers"), ("", "empty expression"), ("1 +", "not an arithmetic expression"),
    ("1" * 600, "at most 500"), ("(" * 240 + "1" + ")" * 240, "too many nested parentheses")])
def test_multi_turn_calculator_refuses_everything_else(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


def test_multi_turn_calculator_takes_deep_but_short_expressions():
    assert calculate("-" * 499 + "1") == "-1" and calculate("(" * 150 + "2" + ")" * 150) == "2"


def test_multi_turn_tool_calls_are_parsed_in_order_and_bad_ones_say_why():
    text = (f"First {call('calculator', expression='1+1')} then <tool_call>{{not json}}</tool_call> "
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>[1, 2]</tool_call><tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x"')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert isinstance(calls[1], CallError) and "not valid JSON" in calls[1].message
    assert calls[2] == ToolCall("python", {"code": "print(1)"})  # arguments given as a JSON string
    assert "expected a JSON object" in calls[3].message and "no \"name\"" in calls[4].message
    assert "<tool_call> without </tool_call>" in calls[5].message and len(calls) == 6
    assert parse_tool_calls("The answer is 42.") == []


def test_multi_turn_tools_environment_answers_with_results_and_the_policys_errors():
    env = make_environment("tools", {"tools": ["calculator"], "max_output_chars": 40, "max_calls_per_turn": 3})
    env.reset({"prompt": "q", "reference": "1"})
    obs = env.step(turn(call("calculator", expression="1234 * 5678") + call("calc", expression="1")
                        + "<tool_call>{oops}</tool_call>" + call("calculator", expression="1/0")))
    lines = obs.text.splitlines()
    assert lines[0] == "calculator: 7006652" and "unknown tool 'calc'; available: calculator" in lines[1]
    assert lines[2].startswith("error: the tool call is not valid JSON")
    assert "at most 3 tool calls per turn" in lines[-1]
    assert (obs.done, obs.tool_calls, obs.tool_errors, obs.role) == (False, 4, 3, "tool")
    assert env.step(turn("So the answer is\n#### 7006652", 2)) == Observation(done=True, role="tool")
    big = env.step(turn(call("calculator", expression="9 ** 120")))
    assert "[output truncated: " in big.text and big.tool_errors == 0  # over the budget: cut, with a note
    wrong = env.step(turn(call("calculator", expr="1")))
    assert wrong.text.startswith('calculator: expected {"expression"') and wrong.tool_errors == 1


@pytest.mark.skipif(check_sandbox(SandboxConfig()) is not None, reason="the bwrap sandbox cannot run here")
def test_multi_turn_python_tool_runs_in_the_sandbox_and_raises_only_for_infra_failures():
    env = make_environment("tools", {"tools": ["python"]})
    ok = env.step(turn(call("python", code="print(sum(range(101)))")))
    assert ok.text == "python: 5050" and ok.tool_errors == 0
    raised = env.step(turn(call("python", code="import os\nprint('partial')\n1 / 0")))
    assert "status failed" in raised.text and "ZeroDivisionError" in raised.text and "partial" in raised.text
    assert raised.tool_errors == 1
    cut = env.step(turn(call("python", code="while True: pass")))
    assert "timeout" in cut.text or "cpu_limit" in cut.text
    broken = make_environment("tools", {"tools": ["python"], "sandbox": {"bwrap_path": "/nonexistent/bwrap"}})
    with pytest.raises(EnvironmentInfraError, match="the sandbox could not run the program"):
        broken.step(turn(call("python", code="print(1)")))


def test_multi_turn_python_tool_limits_are_the_code_rewards():
    from sandbox import DEFAULT_SANDBOX

    env = make_environment("tools", {"tools": ["python"], "sandbox": {"cpu_time_s": 2}})
    config = env.tools["python"].config
    assert config.cpu_time_s == 2 and config.memory_mib == DEFAULT_SANDBOX.memory_mib
    assert config.wall_time_s == DEFAULT_SANDBOX.wall_time_s and config.mode == DEFAULT_SANDBOX.mode


def test_multi_turn_scripted_environment_follows_its_script():
    env = make_environment("scripted", {"observations": ["a", "b"], "done_after": 4, "rewards": [0.5]})
    env.reset({})
    steps = [env.step(turn("x", k)) for k in (1, 2, 3, 4)]
    assert [(o.text, o.done, o.reward) for o in steps] == [("a", False, 0.5), ("b", False, None),
                                                          ("a", False, None), ("", True, None)]
    assert make_environment("scripted").step(turn("x")).done  # no observations: one turn


def test_multi_turn_environment_registry_refuses_duplicates_and_says_what_is_known():
    assert {"tools", "scripted"} <= set(ENVIRONMENTS)
    with pytest.raises(ValueError, match="already registered"):
        register_environment("tools")(object)
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; expected one of \[.*'scripted'"):
        make_environment("nope")
    assert "unexpected keyword argument 'colour'" in check_environment("scripted", {"colour": 1})
    assert "expected a non-empty subset" in check_environment("tools", {"tools": []})
    assert check_environment("tools", {"tools": ["calculator", "python"]}) is None
