"""The calculator task written as an agent with the openai client (examples/tool_calc_agent) is the task of
examples/tool_calc_cpu.yaml (the `tools` environment): the same problems, system prompt, chat template, turns and
token caps, training and held-out settings; through the real agent endpoint over a scripted engine
(tests/scripted_agent.py) its first prompt and the tokens after a tool call are exactly the lock-step runner's
(``cluster.data.chat_prompt_ids``, ``ObservationTokens.ids``), its tool calls are read by the endpoint's hermes
parser, and it scores episodes as the spec's reasoning-gym reward does. ~10 s here."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.agents.loading import check_agent_signature, load_agent
from cluster.data import Example, chat_prompt_ids, chat_template_text
from cluster.data.sources import load_examples
from cluster.loop.observation_tokens import ObservationTokens
from cluster.spec import load_spec
from grpo.environments.tool_env import TOOL_PROMPT
from grpo.rewards import REWARD_FUNCTIONS
from tests.scripted_agent import scripted_episode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def specs():
    return load_spec(EXAMPLES / "tool_calc_agent" / "spec.yaml"), load_spec(EXAMPLES / "tool_calc_cpu.yaml")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def agent():
    return load_agent("agent.py:run", EXAMPLES / "tool_calc_agent")


@pytest.fixture(scope="module")
def problem(specs):
    """The first held-out problem as the agent's row, and its product."""
    example = load_examples(specs[1].data, "held_out")[0][0]
    a, b = (int(x) for x in example.answer and example.question.split("Calculate ")[-1].rstrip(".").split(" * "))
    return {"prompt": example.prompt_as_given, "reference": example.reference, **example.columns}, a, b


def test_agent_tool_calc_agent_is_the_tool_calc_task(specs, agent):
    ours, theirs = specs
    run = load_agent("agent.py:run", EXAMPLES / "tool_calc_agent")
    assert check_agent_signature(run, "agent.py:run", ours.rollout.agent_options) is None
    assert run.__globals__["SYSTEM"] == theirs.data.system_prompt == ours.data.system_prompt == TOOL_PROMPT
    assert ours.data.reasoning_gym == theirs.data.reasoning_gym and ours.data.source == theirs.data.source
    assert chat_template_text(ours.data) == chat_template_text(theirs.data)
    mt = theirs.rollout.multi_turn
    assert ours.rollout.agent_options == {"max_turns": mt.max_turns,
                                          "max_tokens": mt.turn_tokens(theirs.rollout.max_response_tokens)}
    for name in ("prompts_per_step", "group_size", "temperature", "max_response_tokens", "replicas", "kv_cache_gib"):
        assert getattr(ours.rollout, name) == getattr(theirs.rollout, name), name
    for name, unlike in (("model", set()), ("train", set()), ("sync", set()), ("ray", set()),
                         ("algorithm", {"rewards"}), ("eval", {"accuracy_reward", "format_reward"})):
        assert getattr(ours, name).model_dump(exclude=unlike) == getattr(theirs, name).model_dump(exclude=unlike), name
    assert (ours.total_steps, ours.seed) == (theirs.total_steps, theirs.seed)
    assert ours.algorithm.rewards == {} and theirs.algorithm.rewards == {"reasoning_gym": 1.0}


def test_agent_tool_calc_agent_tokens_are_the_lock_step_runners(specs, tokenizer, agent, problem):
    row, a, b = problem
    ours, theirs = specs
    first = CALL % f"{a} * {b}"
    out, record, calls = scripted_episode(ours, tokenizer, agent, [first, f"{a} * {b} = {a * b}\n#### {a * b}"], row)
    assert out == {"reward": 1.0, "accuracy": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
    assert [c.finish_reason for c in record.calls] == ["tool_calls", "stop"] and record.calls[1].extends
    template = chat_template_text(theirs.data)
    example = Example(0, row["prompt"], prompt=row["prompt"])
    (lock_step_prompt,) = chat_prompt_ids(tokenizer, [example], theirs.data.system_prompt, chat_template=template)
    assert record.calls[0].prompt_ids == lock_step_prompt  # the tools environment's first prompt, token for token
    sampled = record.calls[0].completion_ids
    observation = ObservationTokens(tokenizer, template).ids("tool", f"calculator: {a * b}", sampled)
    assert record.calls[1].prompt_ids == lock_step_prompt + sampled + observation  # and its tool observation
    assert calls[1][-1] == {"role": "tool", "tool_call_id": "call_1_0", "content": f"calculator: {a * b}"}


def test_agent_tool_calc_agent_scores_as_the_reasoning_gym_reward(specs, tokenizer, agent, problem):
    row, a, b = problem
    ours = specs[0]
    score = REWARD_FUNCTIONS["reasoning_gym"]
    right, wrong = f"#### {a * b}", f"#### {a * b + 1}"
    assert score([right], [row["reference"]]) == [1.0]
    assert scripted_episode(ours, tokenizer, agent, [right], row)[0]["accuracy"] == 1.0
    assert scripted_episode(ours, tokenizer, agent, [wrong], row)[0]["accuracy"] == 0.0
    # no answer line: the last number of the episode's text, the tool's output included, as in the tools environment
    out, _, _ = scripted_episode(ours, tokenizer, agent, [CALL % f"{a} * {b}", "Done."], row)
    text = f"{CALL % f'{a} * {b}'}\ncalculator: {a * b}\nDone."
    assert out["accuracy"] == score([text], [row["reference"]])[0] == 1.0


def test_agent_tool_calc_agent_tool_errors_and_turn_limit(specs, tokenizer, agent, problem):
    row, a, b = problem
    ours = specs[0]
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d x %d"}}</tool_call>' % (a, b)
    good = CALL % f"{a} * {b}"
    out, record, calls = scripted_episode(ours, tokenizer, agent, [bad, good, good], row)
    assert len(record.calls) == 3 and out["tool_calls"] == 2.0 and out["tool_errors"] == 1.0  # the third turn's
    assert calls[1][-1]["content"].startswith("calculator: ") and "x" in calls[1][-1]["content"]  # call is not run:
    assert calls[2][-1]["content"] == f"calculator: {a * b}"  # the episode ends at max_turns, as in tools
    assert out["accuracy"] == 0.0  # its text's last number is the third call's argument
    unknown = '<tool_call>{"name": "abacus", "arguments": {"expression": "1 + 1"}}</tool_call>'
    out, _, calls = scripted_episode(ours, tokenizer, agent, [unknown, "#### 2"], row)
    assert calls[1][-1]["content"] == "error: unknown tool 'abacus'; available: calculator"
    assert out["tool_errors"] == 1.0


def test_agent_tool_calc_agent_scores_what_it_wrote_when_the_budget_is_spent(specs, tokenizer, agent, problem):
    row, a, b = problem
    ours = specs[0]
    call = CALL % f"{a} * {b}"
    out, record, _ = scripted_episode(ours, tokenizer, agent, [call, "#### 1"], row,
                                      budget=len(first_prompt(ours, tokenizer, row)) + 40)
    assert len(record.calls) == 1 and record.refused and out["tool_calls"] == 1.0 and out["accuracy"] == 1.0


def first_prompt(spec, tokenizer, row) -> list[int]:
    example = Example(0, row["prompt"], prompt=row["prompt"])
    template = chat_template_text(spec.data)
    return chat_prompt_ids(tokenizer, [example], spec.data.system_prompt, chat_template=template)[0]
