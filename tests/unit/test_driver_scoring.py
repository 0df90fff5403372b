"""The driver's score stage (``cluster.loop.scoring``: rewards, EOS and truncation masks, overlong penalty, reward
failures, advantages) on hand-made groups, and the trainer's tempered logprobs; no Ray, no engine."""

import math
from types import SimpleNamespace

import pytest
import torch

from cluster.loop.scoring import OVERLONG, InfraFailureError, Scoring
from cluster.loop.setup import model_eos_ids
from cluster.spec import load_spec_text
from grpo.rewards import REWARD_FUNCTIONS, register_reward_function
from contract.messages import GroupResult
from train_workers.packing import pack_microbatch
from train_workers.policy import ResponseLogprobModel

EOS = 2
SPEC = """\
output_dir: runs/test
total_steps: 1
data:
  train_path: train.jsonl
rollout:
  max_response_tokens: 4
algorithm:
  rewards: {accuracy: 1.0, format: 0.0}
"""


def job(*overrides: str) -> Scoring:
    spec = load_spec_text(SPEC, overrides=overrides)  # only what scoring needs: the spec and the EOS ids
    return Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({EOS}))


def group(gid: int, responses: list[list[int]], texts: list[str]) -> GroupResult:
    """Finish reasons as an engine reports them: ``"stop"`` with an EOS, ``"length"`` without (cut at the cap)."""
    return GroupResult(gid, [EOS, 11], responses, [torch.full((len(r),), -0.5) for r in responses],
                       ["stop" if EOS in r else "length" for r in responses], texts, 0)


# Group 0: a correct EOS-terminated answer, a wrong one with tokens after EOS, and a correct one cut at the cap (its
# prompt holds an EOS id, which must not count). Group 1: all wrong (all-equal).
GROUPS = [group(0, [[5, 6, EOS], [5, EOS, 7, 8], [5, 6, 7, 8]], ["#### 3", "#### 4", "#### 3"]),
          group(1, [[9, EOS], [9, 9, EOS]], ["#### 1", "#### 1"])]
REFS = ["#### 3", "#### 7"]


def test_eos_masks_and_termination():
    batch = job().score(GROUPS, REFS)
    assert batch.terminated == [True, True, False, True, True]
    assert batch.valid_lengths == [3, 2, 4, 2, 3]
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1]
    # rewards [1, 0, 1]: grpo advantages ±(1/3)/std with unbiased std sqrt(1/3); group 1 all-equal → 0
    torch.testing.assert_close(batch.advantages, torch.tensor([0.57735, -1.1547, 0.57735, 0.0, 0.0]), atol=1e-4,
                               rtol=0)
    mb = pack_microbatch(batch.prompt_ids, batch.response_ids, batch.advantages, batch.behaviour_logprobs,
                         list(range(5)), valid_lengths=batch.valid_lengths)
    assert mb.response_mask.sum(-1).tolist() == [3, 2, 4, 2, 3]
    assert mb.response_mask[1].tolist() == [True, True, False, False]


def test_mask_truncated_masks_the_whole_completion_but_keeps_it_in_the_group():
    batch = job("algorithm.mask_truncated=true").score(GROUPS, REFS)
    assert batch.valid_lengths == [3, 2, 0, 2, 3]
    assert batch.advantages[2].item() == pytest.approx(0.57735, abs=1e-4)


def test_overlong_penalty_is_added_to_the_reward():
    # L_max 4, buffer 2: lengths 3 → −0.5·f, 2 → 0, 4 (cut) → −f, with f = 0.4
    batch = job("algorithm.overlong_buffer_tokens=2", "algorithm.overlong_penalty_factor=0.4").score(GROUPS, REFS)
    torch.testing.assert_close(batch.per_function[OVERLONG], torch.tensor([-0.2, 0.0, -0.4, 0.0, -0.2]))
    torch.testing.assert_close(batch.rewards, torch.tensor([0.8, 0.0, 0.6, 0.0, -0.2]))
    assert (batch.advantages[3:] != 0).all()  # the penalty separates group 1's completions


def test_failing_reward_function_counts_or_raises():
    def grader_down(completions, references):
        raise ConnectionError("grader down")

    register_reward_function("test_grader_down")(grader_down)
    try:
        with pytest.raises(RuntimeError, match="'test_grader_down' raised ConnectionError"):
            job("algorithm.rewards={accuracy: 1.0, test_grader_down: 1.0}").score(GROUPS, REFS)
        spec = ("algorithm.rewards={accuracy: 1.0, test_grader_down: 1.0}", "algorithm.reward_on_error=none")
        with pytest.raises(InfraFailureError, match=r"^algorithm.max_infra_failed_fraction: every completion .*"
                                                    r"no score from test_grader_down 5"):
            job(*spec).score(GROUPS, REFS)  # nothing to train on: stopped whatever the threshold
        # scored as the engines finish (RoundScorer): the grader is down for group 1's call only
        def down_for_group_1(completions, references):
            if references[0] == "#### 7":
                raise ConnectionError("grader down")
            return [1.0] * len(completions)

        REWARD_FUNCTIONS.pop("test_grader_down")
        register_reward_function("test_grader_down")(down_for_group_1)
        scoring = job(*spec)
        early = [scoring.rewards(g.texts, [ref] * len(g.texts)) for g, ref in zip(GROUPS, REFS)]
        batch = scoring.score(GROUPS, REFS, early)  # 2 of 5 failed: under the default 0.5
        assert batch.num_failed == 2 and torch.isnan(batch.rewards[3:]).all()
        assert batch.valid_lengths == [3, 2, 4, 0, 0]  # out of the loss: no token and no sequence counts
        assert (batch.advantages[3:] == 0).all() and (batch.advantages[:3] != 0).all()
    finally:
        REWARD_FUNCTIONS.pop("test_grader_down")


def test_normalise_then_sum_is_selected_by_the_spec():
    spec = ("algorithm.rewards={accuracy: 1.0, format: 1.0}", "algorithm.reward_combine=normalise-then-sum")
    batch = job(*spec).score(GROUPS, REFS)
    assert set(batch.per_function) == {"accuracy", "format"}
    torch.testing.assert_close(batch.advantages[:3], torch.tensor([0.57735, -1.1547, 0.57735]), atol=1e-4, rtol=0)


def test_model_eos_ids_from_generation_config_and_tokenizer(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128009]}')
    assert model_eos_ids(str(tmp_path), SimpleNamespace(eos_token_id=128008)) == {128001, 128008, 128009}
    (tmp_path / "generation_config.json").unlink()
    assert model_eos_ids(str(tmp_path), SimpleNamespace(eos_token_id=2)) == {2}


class _Decoder(torch.nn.Module):
    def forward(self, input_ids, position_ids, use_cache):
        return SimpleNamespace(last_hidden_state=torch.ones(1, input_ids.shape[1], 1))


class _LM(torch.nn.Module):
    """A stand-in causal LM whose logits are [2, 1, 0] at every position."""

    def __init__(self):
        super().__init__()
        self.decoder = _Decoder()
        self.head = torch.nn.Linear(1, 3, bias=False)
        self.head.weight.data = torch.tensor([[2.0], [1.0], [0.0]])

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head


def test_trainer_logprobs_use_the_sampling_temperature():
    ids = torch.zeros(1, 2, dtype=torch.long)
    args = (ids, torch.arange(2)[None], torch.tensor([0]), torch.tensor([0]))
    logprobs, _ = ResponseLogprobModel(_LM(), temperature=0.5)(*args)
    assert logprobs.item() == pytest.approx(-0.14293, abs=1e-5)
    untempered, _ = ResponseLogprobModel(_LM(), temperature=1.0)(*args)
    assert untempered.item() == pytest.approx(-0.40761, abs=1e-5)
    assert not math.isclose(logprobs.item(), untempered.item(), abs_tol=0.1)


def test_groups_scored_as_they_arrive_equal_batch_scoring():
    """Rewards computed per group as each engine finishes, joined in request order, give the same batch."""
    from grpo.rewards import combine_rewards

    j = job("algorithm.rewards={accuracy: 1.0, format: 0.5}")
    alg = j.algorithm
    early = [combine_rewards(g.texts, [ref] * len(g.texts), alg.rewards, on_error=alg.reward_on_error)
             for g, ref in zip(GROUPS, REFS)]
    whole, joined = j.score(GROUPS, REFS), j.score(GROUPS, REFS, early)
    torch.testing.assert_close(joined.rewards, whole.rewards)
    torch.testing.assert_close(joined.advantages, whole.advantages)
    assert joined.per_function.keys() == whole.per_function.keys()
    for name in whole.per_function:
        torch.testing.assert_close(joined.per_function[name], whole.per_function[name])
    assert joined.num_failed == whole.num_failed


def test_round_scorer_joins_groups_scored_as_engines_finish():
    """``RoundScorer`` (the rollout pool's ``on_groups`` callback): groups scored as their engines finish, in any
    order, then joined in request order, give the batch of scoring the round at once."""
    from cluster.data import Example
    from cluster.loop.scoring import RoundScorer
    from contract.messages import GroupRequest

    j = job("algorithm.rewards={accuracy: 1.0, format: 0.5}")
    requests = [GroupRequest(g.group_id, g.prompt_ids, len(g.texts), seed=0) for g in GROUPS]
    examples = [Example(index=i, question="q", answer=ref, reference=ref) for i, ref in enumerate(REFS)]
    scorer = RoundScorer(j, requests, examples)
    scorer.on_groups([GROUPS[1]])  # the engine holding group 1 finishes first
    scorer.on_groups([GROUPS[0]])
    joined, whole = scorer.batch(GROUPS), j.score(GROUPS, REFS)
    assert joined.references == whole.references and joined.group_ids.tolist() == whole.group_ids.tolist()
    torch.testing.assert_close(joined.rewards, whole.rewards)
    torch.testing.assert_close(joined.advantages, whole.advantages)
    assert scorer.seconds > 0


def test_trainer_logprobs_use_the_sampling_filters():
    """Logits [2, 1, 0], p = 0.665, 0.245, 0.090: top-k 2 keeps {0, 1}; top-p 0.8 keeps {0, 1} (ascending cumulative
    mass 0.090 <= 0.2 removed), top-p 0.6 keeps {0} (0.090, 0.335 <= 0.4); min-p 0.5 keeps {0}; a target outside the
    kept set is put back."""
    ids = torch.zeros(1, 2, dtype=torch.long)

    def lp(target: int, **filters) -> float:
        args = (ids, torch.arange(2)[None], torch.tensor([0]), torch.tensor([target]))
        return ResponseLogprobModel(_LM(), temperature=1.0, **filters)(*args)[0].item()

    assert lp(0, top_k=2) == pytest.approx(2 - math.log(math.exp(2) + math.exp(1)), abs=1e-6)
    assert lp(1, top_p=0.8) == pytest.approx(1 - math.log(math.exp(2) + math.exp(1)), abs=1e-6)
    assert lp(0, top_p=0.6) == pytest.approx(0.0, abs=1e-6)
    assert lp(0, min_p=0.5) == pytest.approx(0.0, abs=1e-6)
    assert lp(2, top_k=1) == pytest.approx(0 - math.log(math.exp(2) + 1), abs=1e-6)


def test_runtime_weights_change_rewards_and_advantages_not_the_spec():
    """The guard's rollback scales a weight in ``Scoring.weights``; totals and advantages follow, the spec does not."""
    scoring = job()
    scoring.weights["accuracy"] = 0.5
    batch = scoring.score(GROUPS, REFS)
    torch.testing.assert_close(batch.rewards, torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0]))
    assert scoring.algorithm.rewards["accuracy"] == 1.0
    scoring.weights["accuracy"] = 0.0
    assert scoring.score(GROUPS, REFS).rewards.abs().sum() == 0
