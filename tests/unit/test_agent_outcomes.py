"""What an agent episode ends as (``cluster.agents.outcomes``): a float, None or a dict of components read as its
reward; anything else returned, and any raise, an infrastructure failure with a one-line reason naming the agent's
line; a call refused for the episode's token budget (the real ``openai`` error, also when the agent wraps it) a
policy failure trained with reward 0."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from cluster.agents.outcomes import MAX_DETAIL, budget_refusal, outcome_of_error, outcome_of_return
from contract.agents import TOKEN_BUDGET_ERROR, AgentOutcome


@pytest.mark.parametrize("value, reward, components", [
    (1.0, 1.0, {}), (0, 0.0, {}), (-2.5, -2.5, {}),
    ({"correct": 1.0, "style": 0.25}, 1.25, {"correct": 1.0, "style": 0.25}),
    ({"reward": 0.5, "correct": 1.0}, 0.5, {"correct": 1.0}),
])
def test_agent_returns_read_as_rewards(value, reward, components):
    outcome = outcome_of_return(value, 1.5)
    assert (outcome.reward, dict(outcome.components), outcome.failure, outcome.seconds) == (reward, components, "",
                                                                                            1.5)


def test_agent_returning_none_has_no_reward_but_is_no_failure():
    outcome = outcome_of_return(None, 0.1)
    assert outcome.reward is None and outcome.failure == "" and "returned None" in outcome.detail


@pytest.mark.parametrize("value, words", [
    ("0.9", "returned '0.9' of type str"), (True, "of type bool"), (math.nan, "not a finite number"),
    (math.inf, "not a finite number"), ({}, "an empty dict"), ({"mean": 1.0}, "component 'mean' is reserved"),
    ({"agent": 1.0}, "component 'agent' is reserved"), ({"ok": "yes"}, "component 'ok' is 'yes'"),
    ({"a/b": 1.0}, "not a plain string"), ([1.0], "of type list"), (object(), "of type object"),
    pytest.param(10 ** 400, "not a finite number", id="int-too-large-for-a-float"),
    pytest.param({"big": 10 ** 400}, "component 'big' is 1000", id="component-too-large-for-a-float"),
    ({"ok": 1.0, "nan": math.nan}, "component 'nan' is nan"), ({"reward": math.inf, "ok": 1.0}, "'reward' is inf"),
    ({"a": 3e38, "b": 3e38}, "its components sum to 6e+38"), ({"a": -3e38, "b": -3e38}, "sum to -6e+38"),
    pytest.param(-1e308, "not a finite number", id="beyond-float32"),
    pytest.param({"a": 1e39}, "component 'a' is 1e+39", id="component-beyond-float32"),
])
def test_agent_returning_a_non_number_is_an_infrastructure_failure(value, words):
    outcome = outcome_of_return(value, 0.1)
    assert outcome.reward is None and outcome.failure == "infra" and outcome.ended == "infra_failed"
    assert words in outcome.detail and "\n" not in outcome.detail, outcome.detail


def _agent_that_raises():
    raise ValueError("the tool\nbroke " + "x" * 1000)


def test_agent_raising_is_an_infrastructure_failure_naming_its_line():
    try:
        _agent_that_raises()
    except ValueError as exc:
        outcome = outcome_of_error(exc, 2.0, agent_file=__file__)
    assert outcome.failure == "infra" and outcome.reward is None and outcome.seconds == 2.0
    assert outcome.detail.startswith("the agent raised ValueError: the tool broke xxx")
    assert "\n" not in outcome.detail and len(outcome.detail) <= MAX_DETAIL


def _budget_error() -> openai.BadRequestError:
    response = httpx.Response(400, request=httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions"))
    return openai.BadRequestError("no room left", response=response,
                                  body={"message": "no room left", "code": TOKEN_BUDGET_ERROR})


def test_agent_call_refused_for_the_budget_is_a_policy_failure_with_reward_0():
    error = _budget_error()
    assert budget_refusal(error)
    outcome = outcome_of_error(error, 1.0)
    assert (outcome.reward, outcome.failure, outcome.ended) == (0.0, "policy", "token_budget")
    try:  # an agent that wraps the error in its own still ran out of budget
        try:
            raise error
        except openai.BadRequestError as inner:
            raise RuntimeError("my agent gave up") from inner
    except RuntimeError as wrapped:
        assert outcome_of_error(wrapped, 1.0).failure == "policy"
    other = openai.BadRequestError("bad", response=error.response, body={"message": "bad", "code": "other"})
    assert not budget_refusal(other) and outcome_of_error(other, 1.0).failure == "infra"


def test_agent_outcome_of_an_agent_kind_is_kept():
    kind = AgentOutcome(0.5, ended="max_turns", figures={"tool_calls": 2.0})
    outcome = outcome_of_return(kind, 3.0)
    assert (outcome.reward, outcome.ended, dict(outcome.figures), outcome.seconds) == (0.5, "max_turns",
                                                                                       {"tool_calls": 2.0}, 3.0)
