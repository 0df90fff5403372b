"""Our own environments as one more agent kind (``rollout.multi_turn.runner: agent_pool``,
``cluster.agents.kinds.environment``): the ``scripted`` environment run on the local agent pool, each turn a chat call
to a stand-in endpoint (``tests/agent_endpoint.py``) that samples from the in-process fleet, gives exactly the
episodes of the lock-step runner (``cluster.loop.episodes``) for the same requests and turn seeds (the stand-in
seeds each call as the lock-step runner seeds each turn; the endpoint's own seeds give the first turn only the same
tokens, later turns the same layout from other seeds): the same prompt,
sampled and observation tokens, loss mask, behaviour logprobs, policy versions, turns, ending and turn rewards — the
token layout is kept when environments move off the driver. An environment that raises on the pool is an
infrastructure failure of its episode."""

from __future__ import annotations

import pytest
import torch

from cluster.data import Example, chat_prompt_ids
from cluster.in_process import local_agent_pool
from cluster.loop.agent_episodes import AgentEpisodeRunner
from cluster.loop.environment_host import LocalEnvironments
from cluster.loop.episodes import EpisodeRunner
from contract.messages import GroupRequest
from tests.agent_endpoint import StandInEndpoint, fleet_sampler, lock_step_seed
from tests.local_runtime import local_spec, running

TURN = 5
SCRIPTED = {"environment": "scripted", "max_turns": 3, "max_episode_tokens": 40,
            "options": {"observations": ["The tool says 42.", "Still there?"], "rewards": [0.25, 0.5]}}
ROWS = [Example(0, "What is 2 + 3?", "5", "5"), Example(1, "Name a colour.", "red", "red")]


def spec_for(model_dir: str, out: str, **multi_turn):
    return local_spec(model_dir, out, rollout={"max_response_tokens": TURN, "group_size": 2,
                                               "multi_turn": {**SCRIPTED, **multi_turn}})


@pytest.fixture(scope="module")
def both(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("environment_kind"))
    lock_spec, pool_spec = spec_for(tiny_model_dir, out), spec_for(tiny_model_dir, out, runner="agent_pool")
    with running(lock_spec, tiny_model_dir) as (trainer, fleet, versions):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        data = lock_spec.data
        prompts = chat_prompt_ids(tokenizer, ROWS, data.system_prompt, data.prompt_suffix)
        requests = [GroupRequest(i, ids, seed=1000 + 10 * i) for i, ids in enumerate(prompts)]
        mt = lock_spec.rollout.multi_turn
        lock = EpisodeRunner(lock_spec, tokenizer, LocalEnvironments(mt.environment, mt.options, 2, mt.step_timeout_s))
        lock_groups = lock.run(fleet, requests, ROWS)
        endpoint = StandInEndpoint(tokenizer, fleet_sampler(fleet), max_call_tokens=TURN, seeds=lock_step_seed)
        pool = local_agent_pool(pool_spec)
        endpoint.start()
        pool.start()
        try:
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            runner = AgentEpisodeRunner(pool_spec, endpoint, pool, decode, lambda: versions.current)
            pool_groups = runner.run(fleet, requests, ROWS)
            yield {"lock": lock_groups, "pool": pool_groups, "requests": requests, "tokenizer": tokenizer,
                   "fleet": fleet}
        finally:
            pool.shutdown()
            endpoint.shutdown()
            lock.shutdown()


def test_agent_environment_kind_gives_the_lock_step_layout_exactly(both):
    for lock, pool, q in zip(both["lock"], both["pool"], both["requests"]):
        assert pool.episode_of == [0, 1] and pool.prompts == [q.prompt_ids] * 2  # one sequence per episode
        assert pool.response_ids == lock.response_ids
        assert pool.loss_masks == lock.loss_masks
        assert pool.token_versions == [lock.versions_of(i) for i in range(2)]
        for a, b in zip(pool.behaviour_logprobs, lock.behaviour_logprobs):  # one request vs a batch of four
            assert torch.allclose(a, b, atol=1e-5) and torch.equal(a == 0, b == 0)
        for a, b in zip(pool.episodes, lock.episodes):
            assert (a.turns, a.observation_tokens, a.ended, a.turn_reward) == (b.turns, b.observation_tokens,
                                                                                  b.ended, b.turn_reward)
        assert pool.finish_reasons == lock.finish_reasons and pool.texts == lock.texts
    first = both["lock"][0].episodes[0]
    assert first.turns == 2 and first.observation_tokens > 0 and first.ended == "token_budget"  # 40 tokens
    assert first.turn_reward == 0.75 and both["pool"][0].episodes[0].calls == 2


def test_agent_environment_that_raises_on_the_pool_is_an_infrastructure_failure(tiny_model_dir, tmp_path, both):
    import tests.failing_environment  # noqa: F401 - registers "failing" here; the workers import it too

    spec = spec_for(tiny_model_dir, str(tmp_path), runner="agent_pool", environment="failing", options={})
    fleet, tokenizer = both["fleet"], both["tokenizer"]
    endpoint = StandInEndpoint(tokenizer, fleet_sampler(fleet), max_call_tokens=TURN)
    pool = local_agent_pool(spec, imports=("tests.failing_environment",))
    endpoint.start()
    pool.start()
    lines = []
    try:
        runner = AgentEpisodeRunner(spec, endpoint, pool, tokenizer.decode, lambda: 0, lines.append)
        (group,) = runner.run(fleet, both["requests"][:1], ROWS[:1])
    finally:
        pool.shutdown()
        endpoint.shutdown()
    assert all(e.infra_failed for e in group.episodes) and group.loss_masks == [[False], [False]]
    assert "the sandbox is down" in group.episodes[0].detail
    assert len(lines) == 1 and "2 episode(s) ended as infrastructure failure(s)" in lines[0]

