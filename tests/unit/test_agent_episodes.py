"""The loop's agent episode runner (``cluster.loop.agent_episodes``) over a fake endpoint and a fake pool: every
episode of every group submitted at once, each group formed the moment its G episodes end (``on_groups``) while the
others still run, the seeds and budgets each episode is opened with, and every way an episode fails — the agent
raised, made no model call, an engine aborted its call, it ran out of its budget, it outlived ``rollout.timeout_s``
— ending as a counted failure of that episode with one log line per reason, never an exception."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from cluster.loop.agent_episodes import AgentEpisodeRunner
from cluster.data import Example
from contract.agents import AgentOutcome, CallRecord, EpisodeRecord
from contract.messages import GroupRequest, SamplingOverride

EOS = 2


def spec(group_size=2, timeout_s=30.0):
    rollout = SimpleNamespace(group_size=group_size, timeout_s=timeout_s, multi_turn=None,
                              agent_pool=SimpleNamespace(max_episode_tokens=300))
    return SimpleNamespace(rollout=rollout)


class FakeEndpoint:
    def __init__(self, fail_after: int | None = None):
        self.opened = []
        self.closed = []
        self.records = {}
        self.fail_after = fail_after

    def open_episode(self, key, *, seed, max_episode_tokens, group_id=None, sample=None, temperature=None):
        if self.fail_after is not None and len(self.opened) >= self.fail_after:
            raise RuntimeError("the fleet is down")
        self.opened.append(dict(key=key, seed=seed, budget=max_episode_tokens, group_id=group_id, sample=sample,
                                temperature=temperature))
        self.records[key] = EpisodeRecord(key)
        return f"http://endpoint/{key}/v1"

    def close_episode(self, key):
        self.closed.append(key)
        return self.records.pop(key)


class FakePool:
    """Runs ``behaviour(ticket, record) -> AgentOutcome`` in a thread per episode after ``delay(ticket)`` s."""

    def __init__(self, endpoint, behaviour, delay=lambda ticket: 0.0):
        self.endpoint = endpoint
        self.behaviour = behaviour
        self.delay = delay
        self.submitted: list[str] = []

    def submit(self, ticket):
        self.submitted.append(ticket.episode_key)
        future = Future()

        def run():
            time.sleep(self.delay(ticket))
            record = self.endpoint.records.get(ticket.episode_key, EpisodeRecord(ticket.episode_key))
            future.set_result(self.behaviour(ticket, record))

        threading.Thread(target=run, daemon=True).start()
        return future


def answers(ticket, record, reward=1.0):
    record.calls.append(CallRecord([7, 8, 9], [10, 11, EOS], [-0.1, -0.2, -0.3], [5, 5, 5], "stop", False))
    return AgentOutcome(reward, {"correct": reward})


def runner(endpoint, pool, status=None, **kw):
    return AgentEpisodeRunner(spec(**kw), endpoint, pool, lambda ids: " ".join(map(str, ids)), lambda: 9,
                              status or (lambda m: None))


REQUESTS = [GroupRequest(0, [1, 2, 3], seed=100), GroupRequest(1, [4, 5], seed=200)]
ROWS = [Example(0, "q0", "a0", "a0", columns={"level": 1}), Example(1, "q1", "a1", "a1")]


def test_agent_groups_form_as_their_episodes_end_without_waiting_for_others():
    endpoint = FakeEndpoint()
    pool = FakePool(endpoint, answers, delay=lambda t: 0.0 if "-g0-" in t.episode_key else 1.0)
    seen: list[tuple[int, float]] = []
    t0 = time.monotonic()
    groups = runner(endpoint, pool).run(None, REQUESTS, ROWS,
                                        on_groups=lambda gs: seen.extend((g.group_id, time.monotonic() - t0)
                                                                         for g in gs))
    assert len(pool.submitted) == 4  # every episode of every group at once
    assert [gid for gid, _ in seen] == [0, 1] and seen[0][1] < 0.8 <= seen[1][1]
    g = groups[0]
    assert [e["seed"] for e in endpoint.opened] == [100, 101, 200, 201]  # completion i's seed of a group
    assert [e["sample"] for e in endpoint.opened] == [0, 1, 0, 1]
    assert {e["budget"] for e in endpoint.opened} == {300} and {e["temperature"] for e in endpoint.opened} == {None}
    assert g.response_ids == [[10, 11, EOS]] * 2 and g.prompts == [[7, 8, 9]] * 2 and g.episode_of == [0, 1]
    assert g.loss_masks == [[True] * 3] * 2 and g.policy_version == 5
    assert [e.turn_reward for e in g.episodes] == [1.0, 1.0] and g.episodes[0].components == {"correct": 1.0}
    assert g.episodes[0].calls == 1 and g.episodes[0].ended == "done"
    assert sorted(endpoint.closed) == sorted(e["key"] for e in endpoint.opened)


def test_agent_episode_row_holds_the_prompt_and_every_column():
    endpoint, rows = FakeEndpoint(), []

    def behaviour(ticket, record):
        rows.append(dict(ticket.row))
        return answers(ticket, record)

    runner(endpoint, FakePool(endpoint, behaviour)).run(None, REQUESTS[:1], ROWS[:1])
    assert rows[0] == {"level": 1, "prompt": "q0", "reference": "a0"}


def test_agent_held_out_requests_open_episodes_at_their_temperature():
    endpoint = FakeEndpoint()
    q = GroupRequest(0, [1, 2], group_size=1, seed=5, sampling=SamplingOverride(temperature=0.0, max_tokens=8))
    runner(endpoint, FakePool(endpoint, answers)).run(None, [q], ROWS[:1])
    assert endpoint.opened[0]["temperature"] == 0.0 and len(endpoint.opened) == 1


def failing(ticket, record):
    sample = int(ticket.episode_key.rsplit("-s", 1)[1])
    if ticket.episode_key.split("-")[1] == "g0":
        if sample == 0:
            return AgentOutcome(None, failure="infra", detail="the agent raised ValueError: boom (agent.py:3)",
                                ended="infra_failed")
        return AgentOutcome(1.0)  # returned without calling the model
    if sample == 0:
        record.calls.append(CallRecord([7], [10], [-0.1], [5], "abort", False))
        return AgentOutcome(1.0)
    record.calls.append(CallRecord([7], [10, 11], [-0.1, -0.1], [5, 5], "length", False))
    return AgentOutcome(0.0, failure="policy", detail="a call was refused for the episode's token budget")


def test_agent_failures_are_counted_outcomes_with_one_line_per_reason():
    endpoint, lines = FakeEndpoint(), []
    groups = runner(endpoint, FakePool(endpoint, failing), status=lines.append).run(None, REQUESTS, ROWS)
    failed = [e for g in groups for e in g.episodes if e.infra_failed]
    assert len(failed) == 3 and all(math.isnan(e.turn_reward) for e in failed)
    assert {e.detail for e in failed} == {"the agent raised ValueError: boom (agent.py:3)",
                                          "the agent made no model call: nothing to train",
                                          "an engine aborted one of its calls (finish_reason 'abort')"}
    placeholder = groups[0]
    assert placeholder.response_ids == [[3], [3]] and placeholder.loss_masks == [[False], [False]]
    assert placeholder.token_versions == [[9], [9]]  # the trainer's version now: never stale
    policy = groups[1].episodes[1]
    assert (policy.ended, policy.turn_reward, policy.infra_failed) == ("token_budget", 0.0, False)
    assert groups[1].loss_masks[1] == [True, True]  # trained
    assert len(lines) == 4 and all("\n" not in line for line in lines)
    assert any("1 episode(s) ended as policy failure(s): trained with reward 0" in line for line in lines)


def test_agent_episode_past_rollout_timeout_is_an_infrastructure_failure():
    endpoint = FakeEndpoint()
    pool = FakePool(endpoint, answers, delay=lambda t: 5.0 if t.episode_key.endswith("-g1-s1") else 0.0)
    t0 = time.monotonic()
    groups = runner(endpoint, pool, timeout_s=0.5).run(None, REQUESTS, ROWS)
    assert time.monotonic() - t0 < 3
    late = groups[1].episodes[1]
    assert late.infra_failed and "did not end within rollout.timeout_s = 0.5 s" in late.detail
    assert not groups[1].episodes[0].infra_failed and len(endpoint.closed) == 4


def test_agent_endpoint_that_cannot_open_episodes_fails_the_call_and_closes_the_opened_ones():
    endpoint = FakeEndpoint(fail_after=3)
    with pytest.raises(RuntimeError, match="the fleet is down"):
        runner(endpoint, FakePool(endpoint, answers)).run(None, REQUESTS, ROWS)
    assert sorted(endpoint.closed) == sorted(e["key"] for e in endpoint.opened) and len(endpoint.closed) == 3
