"""The ``rollout.multi_turn`` spec section: bad values refused naming the field (``max_turns`` < 1, an environment
that is not registered, options the environment refuses, a context too short for an episode, settings that do not
apply to episodes), and ``examples/tool_calc_cpu.yaml`` accepted by ``grpo-cluster validate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.spec import SpecError, load_spec_text
from cluster.spec.multi_turn import generated_tokens

REPO = Path(__file__).resolve().parents[2]
SPEC = """\
output_dir: runs/test
total_steps: 1
data:
  train_path: train.jsonl
  max_prompt_tokens: 100
rollout:
  max_response_tokens: 32
  multi_turn: {environment: tools, max_turns: 2, max_episode_tokens: 200}
"""


def problem(*overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec_text(SPEC, overrides=overrides)
    return str(info.value)


def test_multi_turn_section_defaults_and_lengths():
    spec = load_spec_text(SPEC)
    mt = spec.rollout.multi_turn
    assert (mt.environment, mt.options, mt.max_turns, mt.max_turn_tokens, mt.parallel) == ("tools", {}, 2, None, 4)
    assert mt.turn_tokens(spec.rollout.max_response_tokens) == 32 and generated_tokens(spec.rollout) == 200
    assert load_spec_text(SPEC.replace("  multi_turn: {environment: tools, max_turns: 2, max_episode_tokens: 200}\n",
                                       "")).rollout.multi_turn is None


def test_multi_turn_max_turns_below_one_is_refused_naming_the_field():
    message = problem("rollout.multi_turn.max_turns=0")
    assert "rollout.multi_turn.max_turns: Input should be greater than or equal to 1 (got 0)" in message


def test_multi_turn_unregistered_environment_says_how_to_register():
    message = problem("rollout.multi_turn.environment=calculator")
    assert "rollout.multi_turn.environment: unknown environment 'calculator'" in message
    assert "expected one registered in grpo.environments.ENVIRONMENTS: scripted, tools" in message
    assert '@register_environment("calculator") from grpo.environments' in message and "--import MODULE" in message


def test_multi_turn_options_are_checked_by_building_the_environment():
    message = problem("rollout.multi_turn.options={tools: [abacus]}")
    assert "rollout.multi_turn.options: environment 'tools' cannot be built with options {'tools': ['abacus']}" \
        in message and "expected a non-empty subset of ['calculator', 'python']" in message


@pytest.mark.parametrize("override, field, words", [
    ("rollout.max_model_len=250", "rollout.max_model_len",
     "data.max_prompt_tokens + rollout.multi_turn.max_episode_tokens = 100 + 200 = 300, got 250"),
    ("algorithm.overlong_buffer_tokens=8", "algorithm.overlong_buffer_tokens", "expected overlong_buffer_tokens null"),
])
def test_multi_turn_conflicts_name_the_field(override, field, words):
    message = problem(override)
    assert f"{field}: " in message and words in message


def test_multi_turn_reward_function_may_not_take_the_environments_component_name():
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    register_reward_function("environment")(lambda completions, references: [0.0] * len(completions))
    try:
        message = problem("algorithm.rewards={accuracy: 1.0, environment: 0.5}")
    finally:
        REWARD_FUNCTIONS.pop("environment")
    assert "algorithm.rewards: 'environment' is the reward component of a multi-turn episode's environment" in message


def test_multi_turn_example_spec_validates(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out_dir = tmp_path / "out"  # the example's output_dir is relative to the working folder, which may be read-only
    assert main(["validate", str(REPO / "examples" / "tool_calc_cpu.yaml"), "--set", f"output_dir={out_dir}"]) == 0
    out = capsys.readouterr().out
    assert "episodes:   multi-turn with environment 'tools' {'tools': ['calculator'], 'max_output_chars': 200}: " \
           "at most 3 turns of 64 tokens, 320 tokens per episode" in out
    assert out.rstrip().endswith("valid: nothing was started or written")
