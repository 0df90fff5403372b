"""The ``textarena`` agent kind (``rollout.agent: "textarena:<id>"``, ``cluster.agents.kinds.textarena_env``) against
scripted model replies: a TextArena game played unchanged, its observations the user messages (each call extending
the previous one), the reply the move, the game's own reward the episode's; the G episodes of a row play the same
game; an invalid move, the token budget and a raising game end the episode as docs/agents.md says; the spec refuses
a missing library, an unknown id, a game of several players and an unknown option, naming the field."""

from __future__ import annotations

import asyncio

import pytest

ta = pytest.importorskip("textarena", reason="the textarena extra is not installed: pip install "
                                             "'grpo-cluster[textarena]'")

from cluster.agents.kinds import ECOSYSTEM_KINDS, build_episode_run, ecosystem_key  # noqa: E402
from cluster.agents.kinds import textarena_env  # noqa: E402
from cluster.agents.plan import AgentPlan, agent_kind_name, build_plan  # noqa: E402
from cluster.spec import SpecError, load_spec  # noqa: E402
from tests.agent_clients import ScriptedClient, budget_error  # noqa: E402

GUESS = "textarena:GuessTheNumber-v0"
SPEC = """\
output_dir: {out}
total_steps: 1
data: {{train_path: train.jsonl}}
rollout:
  agent: "textarena:GuessTheNumber-v0"
  agent_options: {{max_turns: 12}}
"""


def spec_file(folder) -> str:
    (folder / "train.jsonl").write_text('{"prompt": "game 0", "seed": 0}\n')
    (folder / "job.yaml").write_text(SPEC.format(out=folder / "out"))
    return str(folder / "job.yaml")


def refusal(path: str, *overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return str(info.value)


def play(replies, row, key=GUESS, **options):
    client = ScriptedClient(replies)
    run = build_episode_run(AgentPlan("textarena", key, None, options))
    return asyncio.run(run(client, row)), client


def target_of(seed: int) -> int:
    env = ta.make("GuessTheNumber-v0")
    env.reset(num_players=1, seed=seed)
    return env.game_number


def test_agent_textarena_game_is_played_through_the_chat_with_the_games_reward():
    target = target_of(3)
    wrong = 1 if target != 1 else 2
    outcome, client = play([f"My guess: [{wrong}]", f"[{target}]"], {"prompt": "game", "seed": 3})
    assert (outcome.reward, outcome.ended, dict(outcome.components)) == (1.0, "done", {"invalid_move": 0.0})
    assert len(client.calls) == 2 and client.extends_every_call()
    first, second = client.calls[0]["messages"], client.calls[1]["messages"]
    from textarena.agents.basic_agents import STANDARD_GAME_PROMPT

    assert first[0] == {"role": "system", "content": STANDARD_GAME_PROMPT}
    assert "You are playing Guess The Number" in first[1]["content"] and first[1]["content"].startswith("[GAME]")
    hint = "lower" if wrong > target else "higher"
    assert second[-1]["content"] == f"[Player] My guess: [{wrong}]\n[GAME] The target number is {hint}."
    assert "You are playing" not in second[-1]["content"]  # what the observation adds, not the whole log again
    assert "max_tokens" not in client.calls[0] and client.calls[0]["model"] == "policy"


def test_agent_textarena_lost_game_keeps_its_partial_reward_and_the_group_shares_the_game():
    target = target_of(5)
    guesses = [g for g in range(1, 21) if g != target]
    outcome, client = play([f"[{g}]" for g in guesses], {"prompt": "game", "seed": 5}, max_tokens=8)
    last = guesses[len(client.calls) - 1]  # the game's own turn limit ended it
    assert outcome.ended == "done" and 10 <= len(client.calls) <= 11 and client.calls[0]["max_tokens"] == 8
    assert outcome.reward == pytest.approx(1 - abs(last - target) / 19) and 0 < outcome.reward < 1  # closeness
    again, _ = play([f"[{g}]" for g in guesses], {"prompt": "game", "seed": 5})
    assert again.reward == outcome.reward  # the same seed, the same game, whatever ran in between
    by_prompt = [play(["[1]", "[2]"] * 5, {"prompt": "game seven"})[0].reward for _ in range(2)]
    assert by_prompt[0] == by_prompt[1]  # no seed column: a CRC-32 of the prompt


def test_agent_textarena_invalid_moves_end_the_game_with_its_penalty():
    outcome, client = play(["I do not know.", "Still no idea."], {"prompt": "game", "seed": 1})
    assert (outcome.reward, outcome.ended, outcome.components["invalid_move"]) == (0.0, "done", 1.0)
    assert "invalid move" in client.calls[1]["messages"][-1]["content"]


def test_agent_textarena_episode_out_of_budget_or_turns_gets_no_reward():
    wrong = [f"[{g}]" for g in range(1, 21) if g != target_of(2)]
    outcome, _ = play([wrong[0], budget_error()], {"prompt": "game", "seed": 2})
    assert (outcome.reward, outcome.ended, outcome.failure) == (0.0, "token_budget", "")
    outcome, client = play(wrong, {"prompt": "game", "seed": 2}, max_turns=2, system_prompt="")
    assert (outcome.reward, outcome.ended, len(client.calls)) == (0.0, "max_turns", 2)
    assert client.calls[0]["messages"][0]["role"] == "user"  # '' sends no system message


class _Broken(ta.Env):
    def reset(self, num_players, seed=None):
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "Move.")

    def step(self, action):
        raise RuntimeError("the board fell over")


def test_agent_textarena_game_that_raises_fails_the_episode_as_infrastructure():
    from cluster.agents.outcomes import outcome_of_error
    from grpo.environments import EnvironmentInfraError

    if "BrokenForTests-v0" not in ta.envs.registration.ENV_REGISTRY:
        ta.register(id="BrokenForTests-v0", entry_point=_Broken)
    with pytest.raises(EnvironmentInfraError, match="the board fell over") as raised:
        play(["[1]"], {"prompt": "game"}, key="textarena:BrokenForTests-v0")
    assert outcome_of_error(raised.value, 1.0).failure == "infra"


def test_agent_textarena_spec_selects_the_kind_and_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    assert ecosystem_key(GUESS) == (ECOSYSTEM_KINDS["textarena"], "GuessTheNumber-v0")
    assert ecosystem_key("textarena_helpers.py:run") is None and ecosystem_key("my_module:run") is None
    path = spec_file(tmp_path)
    spec = load_spec(path)
    assert agent_kind_name(spec.rollout) == "textarena" and spec.algorithm.rewards == {}
    plan = build_plan(spec)
    assert (plan.kind, plan.key, dict(plan.options)) == ("textarena", GUESS, {"max_turns": 12})
    for override, words in [
        ("rollout.agent=textarena:GuessTheNumbr-v0", "no textarena environment 'GuessTheNumbr-v0'"),
        ("rollout.agent=textarena:TicTacToe-v0", "single-player environments"),
        ("rollout.agent_options={max_turn: 3}", "option max_turn: Extra inputs are not permitted"),
        ("rollout.agent_options={env_kwargs: {colour: 1}}", "unexpected keyword argument 'colour'"),
    ]:
        message = refusal(path, override)
        assert f"--set {override.split('=')[0]}: " in message and words in message, message
        assert "Traceback" not in message and len(message.splitlines()) == 2, message
    assert "close: GuessTheNumber-v0" in refusal(path, "rollout.agent=textarena:GuessTheNumbr-v0")
    monkeypatch.setattr(textarena_env, "_textarena", lambda: (_ for _ in ()).throw(ImportError("no textarena")))
    message = refusal(path)
    assert "rollout.agent" in message and "pip install 'grpo-cluster[textarena]'" in message, message
