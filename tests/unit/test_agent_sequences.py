"""``cluster.loop.agent_sequences``: an agent episode's training sequences from its call records, by hand-computed
examples: one sequence per run of extending calls (inserted tokens masked, logprob 0, the version before them), a
new sequence where the history was rewritten, and records that do not chain refused."""

from __future__ import annotations

import pytest

from cluster.loop.agent_sequences import AgentRecordError, agent_sequences
from contract.agents import CallRecord, EpisodeRecord


def call(prompt, completion, extends, version=1, finish="stop"):
    return CallRecord(list(prompt), list(completion), [-0.5 - i for i in range(len(completion))],
                      [version] * len(completion), finish, extends)


def test_agent_sequences_one_run_masks_what_was_inserted():
    record = EpisodeRecord("e", [call([1, 2], [3, 4], False, 1),
                                 call([1, 2, 3, 4, 90, 91], [5], True, 2, "tool_calls"),
                                 call([1, 2, 3, 4, 90, 91, 5, 92], [6, 7], True, 3, "length")])
    (seq,) = agent_sequences(record)
    assert seq.prompt_ids == [1, 2] and seq.response_ids == [3, 4, 90, 91, 5, 92, 6, 7]
    assert seq.loss_mask == [True, True, False, False, True, False, True, True] and seq.sampled_tokens == 5
    assert seq.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5, 0.0, -0.5, -1.5]
    assert seq.token_versions == [1, 1, 1, 1, 2, 2, 3, 3]  # inserted tokens: the sampled token's before them
    assert (seq.calls, seq.first_call, seq.finish_reason) == (3, 0, "length")


def test_agent_sequences_split_where_the_history_was_rewritten():
    record = EpisodeRecord("e", [call([1, 2], [3], False), call([1, 2, 3, 9], [4], True),
                                 call([8, 1], [5], False), call([8, 1, 5, 9], [6], True), call([7], [], False)])
    first, second, third = agent_sequences(record)
    assert (first.prompt_ids, first.response_ids, first.calls) == ([1, 2], [3, 9, 4], 2)
    assert (second.prompt_ids, second.response_ids, second.first_call) == ([8, 1], [5, 9, 6], 2)
    assert (third.prompt_ids, third.response_ids, third.sampled_tokens) == ([7], [], 0)
    assert agent_sequences(EpisodeRecord("empty")) == []


def test_agent_sequences_refuse_records_that_do_not_chain():
    with pytest.raises(AgentRecordError, match="first call is marked as extending"):
        agent_sequences(EpisodeRecord("e", [call([1], [2], True)]))
    with pytest.raises(AgentRecordError, match="call 1: marked as extending call 0 but its prompt does not start "
                                               "with that call.s prompt and completion"):
        agent_sequences(EpisodeRecord("e", [call([1], [2], False), call([1, 3, 4], [5], True)]))
    bad = CallRecord([1], [2, 3], [-1.0], [1, 1], "stop", False)
    with pytest.raises(AgentRecordError, match="expected 2 logprobs and versions"):
        agent_sequences(EpisodeRecord("e", [bad]))
