"""Multi-turn episodes on the in-process runtime (``cluster.loop.episodes``) with the ``scripted`` environment: the
token layout of 1, 2 and ``max_turns`` turns (sampled vs observation tokens, loss masks, versions), the engine's
behaviour logprobs equal to the policy's on every turn, the episode token budget, environment failures, an engine
replaced mid-episode, and an episode interrupted mid-turn that resumes at that turn on new weights.

The tiny random Llama never samples EOS, so every turn runs to the turn cap (``MAX_TURN``): the layout is exact.
"""

from __future__ import annotations

import time

import pytest
import torch

from cluster.data import Example
from cluster.in_process import LocalFleet
from cluster.loop.environment_host import LocalEnvironments
from cluster.loop.episodes import EpisodeRunner
from cluster.loop.observation_tokens import ObservationTokens
from cluster.loop.partial_rollouts import RoundInterrupted
from contract.messages import GroupRequest
from grpo.environments import ENVIRONMENTS, Observation, register_environment
from tests.local_runtime import PROMPTS, local_spec, requests_for, running, train_on

MAX_TURN = 5
OBSERVATIONS = ["The tool says 42.", "Still there?"]
ROWS = [Example(0, PROMPTS[0], "5", "5"), Example(1, PROMPTS[1], "red", "red")]


def multi_turn_spec(model_dir: str, out: str, **multi_turn):
    section = {"environment": "scripted", "options": {"observations": OBSERVATIONS}, "max_turns": 3,
               "max_episode_tokens": 200, **multi_turn}
    return local_spec(model_dir, out, rollout={"max_response_tokens": MAX_TURN, "multi_turn": section,
                                               "max_staleness": 1, "mode": "async", "partial_rollout": True})


def runner_for(spec, tokenizer) -> EpisodeRunner:
    mt = spec.rollout.multi_turn
    return EpisodeRunner(spec, tokenizer, LocalEnvironments(mt.environment, mt.options, 2, mt.step_timeout_s))


class Interrupting(LocalFleet):
    """A LocalFleet that interrupts its ``at_call``-th generate call (1-based) after ``steps`` token steps."""

    at_call: int | None = None
    steps = 0

    def generate(self, requests, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        self._checks = 0
        return super().generate(requests, *args, **kwargs)

    def interrupted(self, interrupt_epoch):
        if interrupt_epoch is not None and self.calls == self.at_call:
            self._checks += 1
            if self._checks > self.steps:
                self.interrupt(interrupt_epoch)
        return super().interrupted(interrupt_epoch)


@pytest.fixture(scope="module")
def runtime(tiny_model_dir, tmp_path_factory):
    spec = multi_turn_spec(tiny_model_dir, str(tmp_path_factory.mktemp("multi_turn")))
    with running(spec, tiny_model_dir, fleet_cls=Interrupting) as parts:
        yield (spec, *parts)


def runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """(sampled, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def policy_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[R] float32: the model's log-probability of each response token given everything before it."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("done_after, max_turns, turns, ended", [(1, 3, 1, "done"), (2, 3, 2, "done"),
                                                                 (10, 3, 3, "max_turns")])
def test_multi_turn_token_layout_per_turn(runtime, tmp_path, done_after, max_turns, turns, ended):
    spec, _, fleet, _ = runtime
    spec = multi_turn_spec(spec.model.path, str(tmp_path), max_turns=max_turns,
                           options={"observations": OBSERVATIONS, "done_after": done_after})
    runner = runner_for(spec, fleet.tokenizer)
    observations = ObservationTokens(fleet.tokenizer)
    requests = requests_for(fleet.tokenizer, PROMPTS[:2])
    groups = runner.run(fleet, requests, ROWS)
    singles = fleet.generate(requests)  # the same seeds, one completion each
    for group, single in zip(groups, singles):
        assert group.complete and group.policy_version == 0 and len(group.response_ids) == 4
        for i, ids in enumerate(group.response_ids):
            mask, summary = group.loss_masks[i], group.episodes[i]
            segments = runs(mask)
            assert [s for s, _, _ in segments] == [True, False] * (turns - 1) + [True]
            assert all(end - start == MAX_TURN for s, start, end in segments if s)  # every turn hits the cap
            assert ids[:MAX_TURN] == single.response_ids[i]  # turn 1 is the single completion of that seed
            for k, (sampled, start, end) in enumerate(segments):
                if not sampled:  # exactly the template's delimiters and the k-th observation, tokenised once
                    turn_ids = ids[segments[k - 1][1]:segments[k - 1][2]]
                    expected = observations.ids("tool", OBSERVATIONS[(k // 2) % 2], turn_ids)
                    assert ids[start:end] == expected
            lps = group.behaviour_logprobs[i]
            assert torch.all(lps[~torch.tensor(mask)] == 0) and group.versions_of(i) == [0] * len(ids)
            policy = policy_logprobs(fleet.model, group.prompt_ids, ids)
            for sampled, start, end in segments:  # the engine's logprobs are the policy's on every turn
                if sampled:
                    assert float((policy[start:end] - lps[start:end]).abs().max()) < 1e-4
            assert (summary.turns, summary.ended, summary.restarts) == (turns, ended, 0)
            assert summary.observation_tokens == mask.count(False)
            assert group.texts[i] == fleet.tokenizer.decode(ids, skip_special_tokens=True)


def test_multi_turn_token_budget_caps_turns_and_ends_the_episode(runtime, tmp_path):
    spec, _, fleet, _ = runtime
    observation = len(ObservationTokens(fleet.tokenizer).ids("tool", OBSERVATIONS[0], [7]))
    budget = MAX_TURN + observation + 3  # room for 3 tokens of turn 2, none for the next observation
    spec = multi_turn_spec(spec.model.path, str(tmp_path), max_episode_tokens=budget, max_turns=5,
                           options={"observations": OBSERVATIONS, "done_after": 9})
    group = runner_for(spec, fleet.tokenizer).run(fleet, requests_for(fleet.tokenizer, PROMPTS[:1]), ROWS[:1])[0]
    for ids, mask, summary in zip(group.response_ids, group.loss_masks, group.episodes):
        assert len(ids) == budget and [e - s for _, s, e in runs(mask)] == [MAX_TURN, observation, 3]
        assert (summary.turns, summary.ended) == (2, "token_budget")


class Broken:
    """A test environment whose steps raise (or, with ``sleep_s``, take that long)."""

    def __init__(self, sleep_s: float = 0.0):
        self.sleep_s = sleep_s

    def reset(self, row):
        pass

    def step(self, turn):
        if self.sleep_s:
            time.sleep(self.sleep_s)
            return Observation("late")
        raise ConnectionError("the tool server is down")

    def close(self):
        pass


@pytest.fixture
def broken():
    register_environment("broken_test_env")(Broken)
    yield "broken_test_env"
    ENVIRONMENTS.pop("broken_test_env")


@pytest.mark.parametrize("options, cause", [({}, "ConnectionError: the tool server is down"),
                                            ({"sleep_s": 1.0}, "did not return within")])
def test_multi_turn_environment_failures_end_episodes_as_infra_failures(runtime, tmp_path, broken, options, cause):
    spec, _, fleet, _ = runtime
    spec = multi_turn_spec(spec.model.path, str(tmp_path), environment=broken, options=options, step_timeout_s=0.2)
    t0 = time.monotonic()
    group = runner_for(spec, fleet.tokenizer).run(fleet, requests_for(fleet.tokenizer, PROMPTS[:1]), ROWS[:1])[0]
    assert time.monotonic() - t0 < 30  # never a hang
    for ids, summary in zip(group.response_ids, group.episodes):
        assert summary.infra_failed and summary.turns == 1 and cause in summary.detail and len(ids) == MAX_TURN


class Replacing:
    """The runtime's fleet, reporting one engine replaced during its ``at_call``-th generate call (what
    ``EngineFleet.generate`` does after an engine fault: the call's groups come back, sampled again on a new
    engine, and ``restarts`` grew)."""

    def __init__(self, fleet, at_call: int = 2):
        self.fleet, self.at_call, self.calls, self.restarts = fleet, at_call, 0, 0

    def generate(self, requests, *args, **kwargs):
        self.calls += 1
        out = self.fleet.generate(requests, *args, **kwargs)
        self.restarts += self.calls == self.at_call
        return out


def test_multi_turn_engine_replaced_mid_episode_restarts_it_with_the_same_seeds(runtime):
    spec, _, fleet, _ = runtime
    requests = requests_for(fleet.tokenizer, PROMPTS[:1])
    replacing = Replacing(fleet)
    restarted = runner_for(spec, fleet.tokenizer).run(replacing, requests, ROWS[:1])[0]
    assert replacing.calls == 5  # turn 1, turn 2 (discarded), then turns 1, 2 and 3 again
    plain = runner_for(spec, fleet.tokenizer).run(fleet, requests, ROWS[:1])[0]
    assert restarted.response_ids == plain.response_ids and restarted.loss_masks == plain.loss_masks
    assert [e.restarts for e in restarted.episodes] == [1] * 4 and [e.restarts for e in plain.episodes] == [0] * 4
    assert all(e.turns == 3 for e in restarted.episodes)


def test_multi_turn_interrupted_episode_resumes_at_its_turn_on_new_weights(runtime, tmp_path):
    spec, trainer, fleet, versions = runtime
    runner = runner_for(spec, fleet.tokenizer)
    requests = requests_for(fleet.tokenizer, PROMPTS[:1])
    whole = runner.run(fleet, requests, ROWS[:1])[0]  # uninterrupted, policy version 0
    fleet.calls, fleet.at_call, fleet.steps = 0, 2, 2  # turn 2's call: prefill + 1 decode step, then interrupted
    with pytest.raises(RoundInterrupted) as info:
        runner.run(fleet, requests, ROWS[:1], interrupt_epoch=7)
    fleet.at_call = None
    cut = info.value.groups[0]
    assert not cut.complete and all(len(ids) == MAX_TURN + len(ObservationTokens(fleet.tokenizer).ids(
        "tool", OBSERVATIONS[0], ids[:MAX_TURN])) + 2 for ids in cut.response_ids)
    assert all(ids == w[:len(ids)] for ids, w in zip(cut.response_ids, whole.response_ids))  # same seeds

    train_on(trainer, versions, [whole])  # policy version 1 ...
    assert fleet.sync_policy().verified  # ... in the fleet's model
    resumed_requests = [GroupRequest(q.group_id, q.prompt_ids, seed=q.seed, resume_from=g)
                        for q, g in zip(info.value.requests, info.value.groups)]
    group = runner.run(fleet, resumed_requests, ROWS[:1], interrupt_epoch=8, carried=info.value.episodes)[0]
    assert group.complete and group.policy_version == 0 and group.newest_version == 1
    for i, ids in enumerate(group.response_ids):
        segments = runs(group.loss_masks[i])
        assert [s for s, _, _ in segments] == [True, False, True, False, True]  # 3 turns, as uninterrupted
        assert ids[:len(cut.response_ids[i])] == cut.response_ids[i]
        versions_i = group.versions_of(i)
        turn2, turn3 = segments[2], segments[4]
        assert versions_i[:turn2[1] + 2] == [0] * (turn2[1] + 2)  # turn 1, observation, 2 tokens of turn 2: v0
        assert versions_i[turn2[1] + 2:turn2[2]] == [1] * (MAX_TURN - 2)  # the rest of turn 2: v1
        assert versions_i[turn3[1]:] == [1] * MAX_TURN and group.episodes[i].turns == 3
        policy = policy_logprobs(fleet.model, group.prompt_ids, ids)  # version 1's: the tokens it sampled
        v1 = torch.tensor(versions_i) == 1
        v1 &= torch.tensor(group.loss_masks[i])
        assert float((policy[v1] - group.behaviour_logprobs[i][v1]).abs().max()) < 1e-4
