"""Partial rollouts on the in-process fleet: ``interrupt(epoch)`` stops the calls of that epoch at their next token
step, the interrupted completions keep their tokens, and a request with ``resume_from`` continues them on the current
weights (after a train step and a sync: policy version 1), recording the version of every token.

A test fleet (:class:`InterruptAfter`) calls ``interrupt`` itself after a set number of token steps of a call, so the
point of interruption is exact; an interrupt before a call is the plain API.
"""

from __future__ import annotations

import pytest
import torch

from cluster.in_process import LocalFleet
from contract.messages import INTERRUPTED, GroupRequest, GroupResult
from tests.local_runtime import PROMPTS, local_spec, requests_for, running, train_on

MAX_TOKENS = 8


class InterruptAfter(LocalFleet):
    """A LocalFleet that interrupts a call of ``interrupt_epoch`` once ``steps`` of its token steps have run
    (``steps`` None: never)."""

    steps: int | None = None

    def interrupted(self, interrupt_epoch):
        if interrupt_epoch is not None and self.steps is not None:
            self._checks = getattr(self, "_checks", 0) + 1
            if self._checks > self.steps:
                self.interrupt(interrupt_epoch)
        return super().interrupted(interrupt_epoch)


@pytest.fixture
def runtime(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path), rollout={"max_response_tokens": MAX_TOKENS, "max_staleness": 1,
                                                              "partial_rollout": True, "mode": "async"})
    with running(spec, tiny_model_dir, fleet_cls=InterruptAfter) as parts:
        yield (spec, *parts)


def test_interrupt_before_a_call_stops_it_and_later_epochs_run(runtime):
    _, _, fleet, _ = runtime
    fleet.interrupt(3)
    stopped = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:2]), interrupt_epoch=3)
    assert all(g.finish_reasons == [INTERRUPTED] * 4 and g.response_ids == [[]] * 4 for g in stopped)
    assert not any(g.complete for g in stopped)
    running_on = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:2]), interrupt_epoch=4)
    assert all(g.complete and all(len(ids) == MAX_TOKENS for ids in g.response_ids) for g in running_on)


def test_interrupted_completions_resume_on_new_weights(runtime):
    spec, trainer, fleet, versions = runtime
    tok = fleet.tokenizer
    request = requests_for(tok, PROMPTS[:1])[0]
    whole = fleet.generate([request])[0]  # uninterrupted, policy version 0
    fleet.steps = 3  # prefill + 2 decode steps, then the interrupt
    cut = fleet.generate([request], interrupt_epoch=0)[0]
    fleet.steps = None
    assert cut.finish_reasons == [INTERRUPTED] * 4 and [len(ids) for ids in cut.response_ids] == [3] * 4
    assert [ids for ids in cut.response_ids] == [ids[:3] for ids in whole.response_ids]  # the same seeds
    for a, b in zip(cut.behaviour_logprobs, whole.behaviour_logprobs):
        assert float((a - b[:3]).abs().max()) < 1e-5

    train_on(trainer, versions, [whole])  # policy version 1 ...
    report = fleet.sync_policy()  # ... in the fleet's model
    assert report.policy_version == 1 and report.verified

    # completion 0 finished before the interrupt (taken from the whole group): returned as it was
    prior = GroupResult(cut.group_id, cut.prompt_ids, [whole.response_ids[0]] + cut.response_ids[1:],
                        [whole.behaviour_logprobs[0]] + cut.behaviour_logprobs[1:],
                        [whole.finish_reasons[0]] + cut.finish_reasons[1:], [whole.texts[0]] + cut.texts[1:], 0,
                        [[0] * len(whole.response_ids[0])] + cut.token_versions[1:])
    resumed = fleet.generate([GroupRequest(request.group_id, request.prompt_ids, seed=request.seed,
                                           resume_from=prior)])[0]
    assert resumed.complete and resumed.policy_version == 0 and resumed.newest_version == 1
    assert resumed.response_ids[0] == whole.response_ids[0]
    assert torch.equal(resumed.behaviour_logprobs[0], whole.behaviour_logprobs[0])
    assert resumed.versions_of(0) == [0] * MAX_TOKENS
    for i in range(1, 4):
        ids = resumed.response_ids[i]
        assert ids[:3] == cut.response_ids[i]
        assert len(ids) == MAX_TOKENS and resumed.finish_reasons[i] == "length"
        assert resumed.versions_of(i) == [0] * 3 + [1] * (MAX_TOKENS - 3)
        assert torch.equal(resumed.behaviour_logprobs[i][:3], cut.behaviour_logprobs[i])
        assert resumed.behaviour_logprobs[i].shape == (MAX_TOKENS,)
        assert resumed.texts[i] == tok.decode(ids, skip_special_tokens=True)
    # the continued tokens come from the new weights and a fresh seed: not the uninterrupted v0 completion
    assert any(resumed.response_ids[i][3:] != whole.response_ids[i][3:] for i in range(1, 4))
