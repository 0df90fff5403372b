"""An agent episode's training sequences from the endpoint's records (``cluster.loop.agent_sequences``), and how they
are scored (``cluster.loop.scoring``): calls that extend each other are one sequence with the tokens between them
masked; a call that rewrote the history starts a new sequence; the sequences of one episode share its reward and its
advantage, computed over the G episodes of the group (not over sequences), and the step's reward metrics and the
infrastructure-failure limit count episodes."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.loop.agent_sequences import agent_sequences
from cluster.loop.scoring import InfraFailureError, Scoring
from cluster.loop.step_metrics import _sampling_metrics
from cluster.loop.sampling import SamplingResult
from cluster.spec.algorithm import AlgorithmSpec
from contract.agents import CallRecord, EpisodeRecord
from contract.messages import EpisodeSummary, GroupResult
from grpo.advantages import compute_advantages

EOS = 2


def call(prompt, completion, extends, version=3, reason="stop"):
    return CallRecord(list(prompt), list(completion), [-0.5] * len(completion), [version] * len(completion), reason,
                      extends)


def test_agent_calls_that_extend_are_one_sequence_with_observations_masked():
    record = EpisodeRecord("e", [call([1, 2, 3], [10, 11, EOS], False, version=3),
                                 call([1, 2, 3, 10, 11, EOS, 50, 51], [12, EOS], True, version=4)])
    (seq,) = agent_sequences(record)
    assert seq.prompt_ids == [1, 2, 3]
    assert seq.response_ids == [10, 11, EOS, 50, 51, 12, EOS]
    assert seq.loss_mask == [True, True, True, False, False, True, True]
    assert seq.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert seq.token_versions == [3, 3, 3, 3, 3, 4, 4]  # observation tokens: the version of the token before them
    assert seq.calls == 2 and seq.finish_reason == "stop"


def test_agent_rewritten_history_starts_a_new_sequence():
    record = EpisodeRecord("e", [call([1, 2], [10, EOS], False), call([1, 2, 10, EOS, 7], [11, EOS], True),
                                 call([1, 2, 99], [12, EOS], False),  # a summary replaced the turns
                                 call([1, 2, 99, 12, EOS, 8], [13], True, reason="length")])
    first, second = agent_sequences(record)
    assert (first.prompt_ids, first.response_ids) == ([1, 2], [10, EOS, 7, 11, EOS])
    assert (second.prompt_ids, second.response_ids) == ([1, 2, 99], [12, EOS, 8, 13])
    assert second.loss_mask == [True, True, False, True] and second.finish_reason == "length"


def test_agent_call_flagged_extending_whose_tokens_do_not_extend_is_refused():
    from cluster.loop.agent_sequences import AgentRecordError

    record = EpisodeRecord("e", [call([1, 2], [10, EOS], False), call([1, 5, 10, EOS, 7], [11], True)])
    with pytest.raises(AgentRecordError, match="does not start with that call's prompt and completion"):
        agent_sequences(record)
    assert agent_sequences(EpisodeRecord("e")) == []


def summary(reward: float, sequences: int = 1, failed: bool = False) -> EpisodeSummary:
    return EpisodeSummary(turns=1, ended="infra_failed" if failed else "done", turn_reward=reward, calls=1,
                          sequences=sequences)


def agent_group(group_id: int, rewards: list[float], splits: list[int], failed: tuple[int, ...] = ()):
    """A group of len(rewards) episodes; episode i is ``splits[i]`` rows."""
    rows = [(i, k) for i, n in enumerate(splits) for k in range(n)]
    summaries = [summary(math.nan if i in failed else rewards[i], splits[i], i in failed) for i, _ in rows]
    return GroupResult(group_id, [1, 2], [[5 + k, EOS] for _, k in rows],
                       [torch.tensor([-1.0, -1.0]) for _ in rows], ["stop"] * len(rows), ["x"] * len(rows), 0,
                       loss_masks=[[True, True] for _ in rows], episodes=summaries, episode_of=[i for i, _ in rows],
                       prompts=[[1, 2, 3 + k] for _, k in rows])


def agent_scoring(**algorithm) -> Scoring:
    return Scoring(AlgorithmSpec(rewards={}, **algorithm), 64, frozenset({EOS}), episode_reward="agent")


def test_agent_split_episode_shares_its_advantage_computed_over_episodes():
    rewards = [1.0, 0.0, 0.5, 0.0]
    batch = agent_scoring().score([agent_group(7, rewards, [1, 3, 1, 2])], ["ref"])
    expected = compute_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long))  # over the G episodes
    per_row = [0, 1, 1, 1, 2, 3, 3]
    assert torch.allclose(batch.advantages, expected[per_row])
    assert batch.rewards.tolist() == [rewards[i] for i in per_row]
    assert batch.per_function["agent"].tolist() == [rewards[i] for i in per_row]
    assert batch.prompt_ids[2] == [1, 2, 4]  # each row keeps its own prompt
    assert batch.episode_rows() == [0, 3, 4, 6] and batch.episode_ids.tolist()[1:4] == [7 * 65536 + 1] * 3
    metrics = _sampling_metrics(SamplingResult(batch, batch, 1, 0.0), 4, 0)
    assert metrics["reward/mean"] == pytest.approx(sum(rewards) / 4)  # per episode, not per row
    assert metrics["episode/calls_mean"] == 1.0
    assert metrics["episode/rewritten_fraction"] == pytest.approx(0.5)


def test_agent_infra_failure_limit_counts_episodes_not_rows():
    group = agent_group(0, [1.0, 0.0, 0.0, 0.0], [3, 3, 1, 1], failed=(2, 3))  # 2 of 4 episodes, 2 of 8 rows
    batch = agent_scoring(max_infra_failed_fraction=0.5).score([group], ["ref"])
    assert batch.rewards.isnan().sum() == 2 and batch.valid_lengths[-2:] == [0, 0]
    with pytest.raises(InfraFailureError, match="2 of 4 completions"):
        agent_scoring(max_infra_failed_fraction=0.4).score([group], ["ref"])
