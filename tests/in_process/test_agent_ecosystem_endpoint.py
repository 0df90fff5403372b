"""Ecosystem environments through the real agent endpoint (``cluster.endpoint.ChatEndpoint``) over a real sampler
(the in-process fleet's own request-level serving over the tiny random Llama): a TextArena game and a Gymnasium
text environment, each played by its agent kind with a real ``openai.AsyncOpenAI`` client per episode, as an agent
worker runs them. Every call after the first extends the previous one at the endpoint, so each episode is one
training sequence (``cluster.loop.agent_sequences``) holding every call, the environment's observations masked out of
the loss, its sampled tokens in; the first prompt is the environment's own text; the reward is the environment's
(the replies played again on a fresh environment give it)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from openai import AsyncOpenAI

from cluster.agents.kinds import build_episode_run
from cluster.agents.plan import build_plan
from cluster.endpoint import ChatEndpoint
from cluster.loop.agent_sequences import agent_sequences
from tests.ecosystem_replay import replay_gymnasium, replay_textarena
from tests.local_runtime import local_spec, running

REPO = Path(__file__).resolve().parents[2]
SEED = 11


class Recorded:
    """An episode's ``AsyncOpenAI`` that keeps the text of every reply."""

    def __init__(self, client: AsyncOpenAI):
        self.client = client
        self.replies = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs):
        response = await self.client.chat.completions.create(**kwargs)
        self.replies.append(response.choices[0].message.content or "")
        return response


def play_through_endpoint(tiny_model_dir, out: Path, agent: str, options: dict, episodes: int = 2):
    """``episodes`` episodes of ``agent`` (one row, seed :data:`SEED`); (outcomes, records, replies, tokenizer)."""
    spec = local_spec(tiny_model_dir, str(out), rollout={
        "max_response_tokens": 6, "temperature": 1.0, "agent": agent, "agent_options": options,
        "agent_pool": {"max_episode_tokens": 1024}})
    run = build_episode_run(build_plan(spec))
    with running(spec, tiny_model_dir) as (_, fleet, _):
        tokenizer = fleet.engine.tokenizer
        endpoint = ChatEndpoint.from_spec(spec, tokenizer, fleet)  # the fleet's own request-level serving
        endpoint.start()
        try:
            urls = [endpoint.open_episode(f"e{i}", seed=100 + i, max_episode_tokens=1024) for i in range(episodes)]

            async def main():
                clients = [Recorded(AsyncOpenAI(base_url=url, api_key="-", max_retries=0)) for url in urls]
                outcomes = await asyncio.gather(*(run(c, {"prompt": "game", "seed": SEED}) for c in clients))
                return outcomes, [c.replies for c in clients]

            outcomes, replies = asyncio.run(main())
            records = [endpoint.close_episode(f"e{i}") for i in range(episodes)]
        finally:
            endpoint.shutdown()
    return outcomes, records, replies, tokenizer


def check_one_sequence_each(records, tokenizer) -> str:
    """Each record is one training sequence of all its calls; the first prompt's text."""
    for record in records:
        assert len(record.calls) >= 1 and not record.refused
        assert all(call.extends for call in record.calls[1:])
        (sequence,) = agent_sequences(record)
        assert sequence.calls == len(record.calls)
        sampled = sum(len(c.completion_ids) for c in record.calls)
        assert sequence.sampled_tokens == sampled == sum(sequence.loss_mask)
        observed = len(sequence.response_ids) - sampled
        assert observed == sum(not m for m in sequence.loss_mask) and (observed > 0) == (len(record.calls) > 1)
    return tokenizer.decode(records[0].calls[0].prompt_ids)


def test_agent_textarena_game_runs_through_the_real_endpoint(tiny_model_dir, tmp_path):
    pytest.importorskip("textarena", reason="the textarena extra is not installed: pip install "
                                                 "'grpo-cluster[textarena]'")
    outcomes, records, replies, tokenizer = play_through_endpoint(
        tiny_model_dir, tmp_path, "textarena:GuessTheNumber-v0", {"max_tokens": 6, "max_turns": 4})
    assert "You are playing Guess The Number" in check_one_sequence_each(records, tokenizer)
    for outcome, moves in zip(outcomes, replies):
        reward, done = replay_textarena("GuessTheNumber-v0", SEED, moves)
        assert outcome.reward == reward
        assert outcome.ended == ("done" if done else "max_turns")


def test_agent_gymnasium_text_environment_runs_through_the_real_endpoint(tiny_model_dir, tmp_path):
    pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed: pip install "
                                                  "'grpo-cluster[gymnasium]'")
    shutil.copy(REPO / "examples" / "gymnasium" / "arithmetic_env.py", tmp_path / "arithmetic_env.py")
    outcomes, records, replies, tokenizer = play_through_endpoint(
        tiny_model_dir, tmp_path, f"gymnasium:{tmp_path / 'arithmetic_env.py'}:ArithmeticDrill-v0", {})
    assert "Answer with the number." in check_one_sequence_each(records, tokenizer)
    for outcome, answers in zip(outcomes, replies):
        total = replay_gymnasium("ArithmeticDrill-v0", SEED, answers)
        assert len(answers) == 3 and outcome.ended == "done" and outcome.reward == pytest.approx(total)
