"""Partial rollouts' pure bookkeeping (``rollout_workers.partial``, ``cluster.loop.partial_rollouts``), no engine: the
request that continues an interrupted completion from its tokens (prompt + tokens so far, length cap reduced, seed),
per-token policy versions and the group's oldest version, refusals; the carried round's restart rule and counts;
the older-token fraction; the spec field's refusals."""

from __future__ import annotations

import pytest
import torch

from contract.figures import FleetFigures
from cluster.loop.partial_rollouts import PartialRollouts, RoundInterrupted, older_token_fraction
from contract.messages import GroupRequest, GroupResult
from rollout_workers.partial import CompletionState, assemble_group, completion_jobs, resume_seed

PROMPT = [11, 12, 13]


def _interrupted(versions=((0, 0), (), (0, 0, 0))) -> GroupResult:
    """Group 5 (G = 3): completion 0 interrupted after 2 tokens, 1 finished with EOS (token 2) at version 0,
    2 interrupted after 3 tokens."""
    ids = [[21, 22], [2], [31, 32, 33]]
    return GroupResult(5, PROMPT, ids, [torch.tensor([-0.5, -1.0]), torch.tensor([-0.25]),
                                        torch.tensor([-1.5, -2.0, -2.5])],
                       ["interrupted", "stop", "interrupted"], ["ab", "", "xyz"], 0,
                       [list(versions[0]), [0], list(versions[2])])


def test_partial_rollout_fresh_group_uses_vllm_child_seeds():
    jobs = completion_jobs(GroupRequest(5, PROMPT, group_size=3, seed=40), 8, max_tokens=16)
    assert [(j.sample, j.prompt_ids, j.max_tokens, j.seed) for j in jobs] == [
        (0, PROMPT, 16, 40), (1, PROMPT, 16, 41), (2, PROMPT, 16, 42)]
    assert all(j.prefix_ids == [] and j.prefix_logprobs.numel() == 0 for j in jobs)
    assert resume_seed(None, 1, 0) is None and resume_seed(None, 1, 5) is None


def test_partial_rollout_resume_request_is_prompt_plus_tokens_with_reduced_cap():
    jobs = completion_jobs(GroupRequest(5, PROMPT, group_size=3, seed=40, resume_from=_interrupted()), 8,
                           max_tokens=16)
    assert [(j.sample, j.prompt_ids, j.max_tokens) for j in jobs] == [
        (0, PROMPT + [21, 22], 14), (2, PROMPT + [31, 32, 33], 13)]  # the finished completion is not sent
    assert [j.prefix_ids for j in jobs] == [[21, 22], [31, 32, 33]]
    assert torch.equal(jobs[1].prefix_logprobs, torch.tensor([-1.5, -2.0, -2.5]))
    assert [j.prefix_versions for j in jobs] == [[0, 0], [0, 0, 0]]
    # a continued completion's seed depends on how far it got, and is not the one its first tokens used
    assert jobs[0].seed == resume_seed(40, 0, 2) != 40 and jobs[1].seed == resume_seed(40, 2, 3) != 42
    assert 0 <= jobs[0].seed < 2**31 and resume_seed(40, 0, 2) != resume_seed(40, 0, 3)


def test_partial_rollout_resume_refusals():
    prior = _interrupted()
    with pytest.raises(ValueError, match="resume_from is group 5 with 3 prompt tokens and 3 completions"):
        completion_jobs(GroupRequest(5, PROMPT, group_size=2, resume_from=prior), 8, max_tokens=16)
    with pytest.raises(ValueError, match="resume_from is group 5"):
        completion_jobs(GroupRequest(6, PROMPT, group_size=3, resume_from=prior), 8, max_tokens=16)
    with pytest.raises(ValueError, match="interrupted with 3 tokens, expected fewer than the length cap 3"):
        completion_jobs(GroupRequest(5, PROMPT, group_size=3, resume_from=prior), 8, max_tokens=3)
    with pytest.raises(ValueError, match="one logprob per token"):
        CompletionState().add([1, 2], [-0.1], "a")


def test_partial_rollout_assemble_spans_versions_and_keeps_finished_completions():
    request = GroupRequest(5, PROMPT, group_size=3, seed=40, resume_from=_interrupted())
    jobs = completion_jobs(request, 8, max_tokens=16)
    done0, done2 = CompletionState(), CompletionState()
    done0.add([23, 2], [-0.75, -0.125], "c")
    done0.finish_reason = "stop"
    done2.add([34], [-3.0], "w")  # interrupted again after one more token
    group = assemble_group(request, 8, {0: (jobs[0], done0), 2: (jobs[1], done2)}, engine_version=1,
                           decode=lambda ids: "|".join(map(str, ids)))
    assert group.response_ids == [[21, 22, 23, 2], [2], [31, 32, 33, 34]]
    assert group.token_versions == [[0, 0, 1, 1], [0], [0, 0, 0, 1]]
    assert group.finish_reasons == ["stop", "stop", "interrupted"] and not group.complete
    assert torch.equal(group.behaviour_logprobs[0], torch.tensor([-0.5, -1.0, -0.75, -0.125]))
    assert group.texts == ["21|22|23|2", "", "31|32|33|34"]  # continued: decoded from all its tokens
    assert group.policy_version == 0 and group.newest_version == 1
    fresh = GroupRequest(6, PROMPT, group_size=2, seed=1)
    states = {i: (j, CompletionState(ids=[9] * (i + 1), logprobs=[-1.0] * (i + 1), text="t", finish_reason="length"))
              for i, j in enumerate(completion_jobs(fresh, 8, max_tokens=16))}
    g = assemble_group(fresh, 8, states, engine_version=3, decode=lambda ids: "never")
    assert g.token_versions == [[3], [3, 3]] and g.policy_version == 3 and g.finish_reasons == ["length"] * 2
    assert g.texts == ["t", "t"] and g.complete
    aborted = {i: (j, CompletionState()) for i, j in enumerate(completion_jobs(fresh, 8, max_tokens=16))}
    empty = assemble_group(fresh, 8, aborted, engine_version=4, decode=str)
    assert empty.finish_reasons == ["interrupted"] * 2 and empty.policy_version == 4  # no token: the engine's


def test_partial_rollout_carry_take_restart_and_counts():
    partial = PartialRollouts(max_staleness=2)
    assert partial.begin_step() == 1 and partial.begin_step() == 2
    requests = [GroupRequest(5, PROMPT, group_size=3, seed=40), GroupRequest(6, PROMPT, group_size=3, seed=41)]
    old = _interrupted()
    newer = GroupResult(6, PROMPT, [[1], [2], [3]], [torch.zeros(1)] * 3, ["stop", "interrupted", "stop"],
                        ["a", "b", "c"], 2, [[2], [2], [2]])
    carried = partial.carry(4, {"prompts": "pos"}, 3, RoundInterrupted(["e5", "e6"], requests, [old, newer]),
                            FleetFigures())
    assert carried.num_groups == 2 and partial.interrupted == 3
    assert [q.resume_from for q in carried.requests] == [old, newer]
    with pytest.raises(ValueError, match="a round of step 4 is carried over already"):
        partial.carry(5, {}, 3, RoundInterrupted([], [], []), FleetFigures())
    assert partial.take(3, trained_at=3) is None and partial.carried is carried  # another step's: kept
    taken = partial.take(4, trained_at=3)  # group 5's oldest token (0) would be 3 behind > 2: sampled afresh
    assert partial.carried is None and taken.position == {"prompts": "pos"}
    assert taken.requests[0].resume_from is None and taken.requests[1].resume_from is newer
    assert (partial.resumed, partial.restarted) == (1, 1)


def test_partial_rollout_older_token_fraction_counts_loss_tokens_only():
    # row 0: 4 loss tokens, 2 older than its newest (1); row 1: one version only; row 2: masked (0 loss tokens)
    assert older_token_fraction([[0, 0, 1, 1, 0], [3, 3], [0, 1]], [4, 2, 0]) == pytest.approx(2 / 6)
    assert older_token_fraction([torch.tensor([5, 5])], [2]) == 0.0
    assert older_token_fraction([], []) == 0.0


def test_partial_rollout_spec_refusals():
    from cluster.spec import load_spec_text

    base = "output_dir: out\ntotal_steps: 2\nmodel: {path: m}\ndata: {train_path: t.jsonl}\n"
    with pytest.raises(Exception, match="rollout.partial_rollout") as info:
        load_spec_text(base + "rollout: {mode: one_step_off, max_staleness: 1, partial_rollout: true}\n")
    assert "expected mode 'async', got 'one_step_off'" in str(info.value)
    implied = load_spec_text(base + "rollout: {partial_rollout: true}\n").rollout  # implies mode async, staleness 1
    assert (implied.mode, implied.max_staleness) == ("async", 1)
    with pytest.raises(Exception, match="rollout.partial_rollout"):
        load_spec_text(base + "rollout: {mode: sync, partial_rollout: true}\n")
    with pytest.raises(Exception, match="dynamic_sampling false"):
        load_spec_text(base + "rollout: {mode: async, max_staleness: 1, partial_rollout: true}\n"
                       "algorithm: {dynamic_sampling: true}\n")
    spec = load_spec_text(base + "rollout: {mode: async, max_staleness: 1, partial_rollout: true}\n")
    assert spec.rollout.partial_rollout is True
    for value in ("1", "'yes'", "'true'"):  # a strict bool, like train.sequence_parallel: only true/false
        with pytest.raises(Exception, match="rollout.partial_rollout"):
            load_spec_text(base + f"rollout: {{mode: async, max_staleness: 1, partial_rollout: {value}}}\n")
