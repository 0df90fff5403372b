"""The ``gymnasium`` agent kind (``rollout.agent: "gymnasium:<id>"``, ``cluster.agents.kinds.gymnasium_env``) against
scripted model replies: a toy-text environment rendered as ``ansi`` text and a ``Text``-space environment a user
registers with the plain Gymnasium API (``examples/gymnasium/arithmetic_env.py``), run unchanged, each observation a
user message extending the conversation, each reply parsed into the action space, the return the reward; a reply
that is no action, the token budget and the step limit end the episode as docs/agents.md says; the spec refuses what
is not a text environment, naming the field; ``grpo-cluster submit`` ships the environment's file."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

gym = pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed: pip install "
                                              "'grpo-cluster[gymnasium]'")

from cluster.agents.kinds import build_episode_run  # noqa: E402
from cluster.agents.kinds.gymnasium_env import ansi_text  # noqa: E402
from cluster.agents.plan import AgentPlan, agent_kind_name, build_plan  # noqa: E402
from cluster.spec import SpecError, load_spec  # noqa: E402
from tests.agent_clients import ScriptedClient, budget_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gymnasium"
LAKE = "gymnasium:FrozenLake-v1"
MOVES = {"env_kwargs": {"is_slippery": False}, "action_names": ["left", "down", "right", "up"]}
DRILL = "gymnasium:arithmetic_env.py:ArithmeticDrill-v0"


def play(replies, row, key=LAKE, folder=None, **options):
    client = ScriptedClient(replies)
    run = build_episode_run(AgentPlan("gymnasium", key, None if folder is None else (str(folder), None), options))
    return asyncio.run(run(client, row)), client


def test_agent_gymnasium_toy_text_environment_is_played_through_the_chat():
    replies = ["right", "I will go right.", "down", "Down!", "down", "RIGHT"]  # the shortest path to the goal
    outcome, client = play(replies, {"prompt": "lake"}, **MOVES)
    assert (outcome.reward, outcome.ended, dict(outcome.components)) == (1.0, "done", {"invalid_action": 0.0})
    assert len(client.calls) == 6 and client.extends_every_call()
    first = client.calls[0]["messages"]
    assert first == [{"role": "user", "content": "Reply with one action: left, down, right or up.\n\n"
                                                 "[S]FFF\nFHFH\nFFFH\nHFFG"}]
    assert client.calls[1]["messages"][-1]["content"] == "(Right)\nS[F]FF\nFHFH\nFFFH\nHFFG"
    assert ansi_text("\x1b[41mS\x1b[0mFF\n") == "[S]FF"


def test_agent_gymnasium_discrete_actions_are_numbers_without_names_and_a_non_action_ends_the_episode():
    outcome, client = play(["Let me try 1, no, 2", "4 is not a move"], {"prompt": "lake"},
                           env_kwargs={"is_slippery": False})
    assert "a whole number from 0 to 3" in client.calls[0]["messages"][0]["content"]
    assert "(Right)" in client.calls[1]["messages"][-1]["content"]  # the last number said: 2, right
    assert (outcome.reward, outcome.ended, outcome.components["invalid_action"]) == (0.0, "done", 1.0)
    outcome, _ = play(["down", "right", "left"], {"prompt": "lake"}, **MOVES)  # into the hole at (1, 1)
    assert (outcome.reward, outcome.ended, outcome.components["invalid_action"]) == (0.0, "done", 0.0)


def test_agent_gymnasium_episode_out_of_budget_or_steps_keeps_its_return():
    outcome, _ = play(["left", budget_error()], {"prompt": "lake"}, **MOVES)
    assert (outcome.reward, outcome.ended, outcome.failure) == (0.0, "token_budget", "")
    outcome, client = play(["left"] * 5, {"prompt": "lake"}, max_turns=3, max_tokens=4, system_prompt="Play.",
                           **MOVES)
    assert (outcome.ended, len(client.calls), client.calls[0]["max_tokens"]) == ("max_turns", 3, 4)
    assert client.calls[0]["messages"][0] == {"role": "system", "content": "Play."}


def test_agent_gymnasium_text_environment_registered_by_the_users_file(tmp_path):
    shutil.copy(EXAMPLE / "arithmetic_env.py", tmp_path / "arithmetic_env.py")
    replies = ["The answer is 9.", "16", "1"]  # seed 1: 4 + 5, 7 + 9, 0 + 1
    outcome, client = play(replies, {"prompt": "drill", "seed": 1}, key=DRILL, folder=tmp_path)
    assert (outcome.reward, outcome.ended) == (pytest.approx(1.0), "done") and client.extends_every_call()
    assert client.calls[0]["messages"] == [{"role": "user", "content": "What is 4 + 5? Answer with the number."}]
    assert client.calls[1]["messages"][-1]["content"] == "Right. What is 7 + 9? Answer with the number."
    half, _ = play(["9", "15", "1"], {"prompt": "drill", "seed": 1}, key=DRILL, folder=tmp_path)
    assert half.reward == pytest.approx(2 / 3)  # the return: the share it got right
    other, client = play(["0", "0", "0"], {"prompt": "drill", "seed": 2}, key=DRILL, folder=tmp_path)
    assert client.calls[0]["messages"][0]["content"] != "What is 4 + 5? Answer with the number."


def test_agent_gymnasium_step_that_raises_fails_the_episode_as_infrastructure(tmp_path):
    from grpo.environments import EnvironmentInfraError

    (tmp_path / "broken_env.py").write_text(
        "import gymnasium\nfrom gymnasium import spaces\n\n\n"
        "class Broken(gymnasium.Env):\n"
        "    observation_space = spaces.Text(32)\n    action_space = spaces.Text(32)\n\n"
        "    def reset(self, *, seed=None, options=None):\n        return 'go', {}\n\n"
        "    def step(self, action):\n        raise RuntimeError('the lake froze over')\n\n\n"
        "gymnasium.register(id='BrokenForTests-v0', entry_point=Broken)\n")
    with pytest.raises(EnvironmentInfraError, match="the lake froze over"):
        play(["go"], {"prompt": "x"}, key="gymnasium:broken_env.py:BrokenForTests-v0", folder=tmp_path)


SPEC = """\
output_dir: {out}
total_steps: 1
data: {{train_path: train.jsonl}}
rollout:
  agent: "gymnasium:arithmetic_env.py:ArithmeticDrill-v0"
"""


def refusal(path: str, *overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return str(info.value)


def test_agent_gymnasium_spec_selects_the_kind_ships_the_file_and_refuses_what_is_not_text(tmp_path):
    from cluster.ops.reward_files import reward_files

    shutil.copy(EXAMPLE / "arithmetic_env.py", tmp_path / "arithmetic_env.py")
    (tmp_path / "train.jsonl").write_text('{"prompt": "drill 0", "seed": 0}\n')
    (tmp_path / "job.yaml").write_text(SPEC.format(out=tmp_path / "out"))
    path = str(tmp_path / "job.yaml")
    spec = load_spec(path)
    assert agent_kind_name(spec.rollout) == "gymnasium" and build_plan(spec).kind == "gymnasium"
    root = tmp_path / "upload"
    root.mkdir()
    assert reward_files(spec, tmp_path, root) == {"arithmetic_env.py": (tmp_path / "arithmetic_env.py").read_text()}
    assert load_spec(path, ["rollout.agent=gymnasium:FrozenLake-v1"]).rollout.agent == LAKE
    for override, field, words in [
        ("rollout.agent=gymnasium:CartPole-v1", "rollout.agent", "not a text environment"),
        ("rollout.agent=gymnasium:Blackjack-v1", "rollout.agent", "renders no 'ansi' text"),
        ("rollout.agent=gymnasium:NoSuchEnv-v0", "rollout.agent", "gymnasium.make cannot make it"),
        ("rollout.agent=gymnasium:missing.py:X-v0", "rollout.agent", "missing.py not found"),
        ("rollout.agent_options={action_names: [left, right]}", "rollout.agent_options",
         "has 2 name(s); expected one per action"),
        ("rollout.agent_options={actions: [left]}", "rollout.agent_options", "option actions"),
    ]:
        message = refusal(path, *(["rollout.agent=gymnasium:FrozenLake-v1"] if "action_names" in override else []),
                          override)
        assert f"--set {field}" in message.splitlines()[1] and words in message, message
        assert "Traceback" not in message and len(message.splitlines()) == 2, message
