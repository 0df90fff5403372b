"""Unit tests for cluster.loop.sampling: DAPO dynamic sampling rounds and their bound, the group-size schedule and its
adaptive rise, and RolloutBatch select/concat."""

import pytest
import torch

from cluster.loop.sampling import GroupSizeController, informative_group_ids, sample_groups
from contract.batches import RolloutBatch

G = 2  # completions per group in the fake rounds


def fake_batch(group_ids: list[int], informative: list[bool]) -> RolloutBatch:
    """G rows per group; an informative group has advantages [+1, −1], an all-equal one [0, 0]."""
    rows = [(gid, s) for gid in group_ids for s in range(G)]
    adv = [(1.0 if s == 0 else -1.0) if informative[group_ids.index(gid)] else 0.0 for gid, s in rows]
    n = len(rows)
    return RolloutBatch(
        prompt_ids=[[gid] for gid, _ in rows], response_ids=[[gid, s] for gid, s in rows],
        behaviour_logprobs=[torch.zeros(2) for _ in rows], finish_reasons=["stop"] * n, texts=["t"] * n,
        references=["r"] * n, versions=[0] * n, group_ids=torch.tensor([gid for gid, _ in rows]),
        valid_lengths=[2] * n, terminated=[True] * n, rewards=torch.tensor(adv),
        per_function={"acc": torch.tensor(adv)}, advantages=torch.tensor(adv), num_failed=1)


class Rounds:
    """A scripted ``sample_round``: round i marks its groups informative by ``script[i]`` (cycled per group)."""

    def __init__(self, *script: list[bool]):
        self.script, self.calls, self.next_id = list(script), [], 0

    def __call__(self, k: int) -> RolloutBatch:
        flags = self.script[min(len(self.calls), len(self.script) - 1)]
        self.calls.append(k)
        ids = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        return fake_batch(ids, [flags[i % len(flags)] for i in range(k)])


def kept_groups(result) -> list[int]:
    return list(dict.fromkeys(result.batch.group_ids.tolist()))


def test_without_dynamic_sampling_one_round_keeps_everything():
    rounds = Rounds([True, False, False, True])
    result = sample_groups(rounds, 4, dynamic=False, max_rounds=5)
    assert rounds.calls == [4] and result.rounds == 1
    assert kept_groups(result) == [0, 1, 2, 3] and result.all_equal_fraction == 0.5


def test_dynamic_sampling_fills_the_batch_with_informative_groups():
    rounds = Rounds([True, False, False, True], [False, True, True, True])
    result = sample_groups(rounds, 4, dynamic=True, max_rounds=5)
    # Round 1 keeps groups 0 and 3 (rate 1/2), so round 2 asks for ceil(2 / 0.5) = 4 prompts and keeps the first two
    # informative ones (5, 6); group 7 is surplus.
    assert rounds.calls == [4, 4] and result.rounds == 2
    assert kept_groups(result) == [0, 3, 5, 6]
    assert len(result.batch) == 4 * G and (result.batch.advantages != 0).all()
    assert result.num_groups_sampled == 8 and result.all_equal_fraction == pytest.approx(3 / 8)
    assert result.sampled.num_failed == 2 and result.batch.num_failed == 2


def test_later_rounds_are_sized_by_the_informative_rate():
    rounds = Rounds([True, True, True, False], [True])
    result = sample_groups(rounds, 4, dynamic=True, max_rounds=3)
    assert rounds.calls == [4, 2] and kept_groups(result) == [0, 1, 2, 4]


def test_rounds_are_bounded_and_partial_batches_train():
    rounds = Rounds([False, False, False, True], [False])
    result = sample_groups(rounds, 4, dynamic=True, max_rounds=3)
    assert rounds.calls == [4, 4, 4] and result.rounds == 3
    assert kept_groups(result) == [3]
    assert result.all_equal_fraction == pytest.approx(11 / 12)


def test_no_informative_group_after_the_bound_keeps_the_last_round():
    rounds = Rounds([False])
    result = sample_groups(rounds, 4, dynamic=True, max_rounds=2)
    assert rounds.calls == [4, 4] and result.rounds == 2
    assert kept_groups(result) == [4, 5, 6, 7] and result.all_equal_fraction == 1.0


def test_sample_groups_validation():
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        sample_groups(Rounds([True]), 4, dynamic=True, max_rounds=0)


def test_informative_group_ids_in_first_appearance_order():
    adv = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 1.0])
    gids = torch.tensor([7, 7, 3, 3, 5, 5, 9, 9])
    assert informative_group_ids(adv, gids) == [3, 9]


def test_select_and_concat_keep_rows_aligned():
    a, b = fake_batch([0, 1], [True, False]), fake_batch([2], [True])
    both = RolloutBatch.concat([a, b])
    assert len(both) == 6 and both.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and both.num_failed == 2
    sub = both.select([5, 0])
    assert sub.group_ids.tolist() == [2, 0] and sub.response_ids == [[2, 1], [0, 0]]
    assert sub.per_function["acc"].tolist() == [-1.0, 1.0] and sub.valid_lengths == [2, 2]


def test_group_size_schedule_by_step():
    ctl = GroupSizeController(4, [(3, 8), (10, 16)])
    assert [ctl.group_size(s) for s in (1, 2, 3, 9, 10, 50)] == [4, 4, 8, 8, 16, 16]
    ctl.observe(5, 1.0)  # no max_size: never rises
    assert ctl.group_size(6) == 8


def test_group_size_rises_when_all_equal_fraction_exceeds_threshold():
    ctl = GroupSizeController(8, max_size=32, rise_threshold=0.5)
    assert ctl.group_size(1) == 8
    ctl.observe(1, 0.75)
    assert ctl.group_size(2) == 16
    ctl.observe(2, 0.5)  # not above the threshold
    assert ctl.group_size(3) == 16
    ctl.observe(3, 0.9)
    ctl.observe(4, 0.9)
    assert ctl.group_size(5) == 32  # capped
    ctl.observe(5, 0.0)  # a rise is never undone
    assert ctl.group_size(6) == 32
    state = ctl.state_dict()
    again = GroupSizeController(8, max_size=32)
    again.load_state_dict(state)
    assert again.group_size(6) == 32


def test_schedule_and_rise_combine():
    ctl = GroupSizeController(8, [(1, 8), (100, 16)], max_size=64, rise_threshold=0.8)
    ctl.observe(1, 0.9)
    assert ctl.group_size(2) == 16 and ctl.group_size(100) == 16
    ctl.observe(100, 0.9)
    assert ctl.group_size(101) == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(base=1), "group sizes"), (dict(base=4, schedule=[(2, 8), (2, 16)]), "strictly increasing"),
    (dict(base=4, schedule=[(0, 8)]), "strictly increasing"), (dict(base=4, max_size=1), "max_size"),
    (dict(base=4, rise_threshold=0.0), "rise_threshold"), (dict(base=4, schedule=[(1, 1)]), "group sizes"),
])
def test_group_size_controller_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupSizeController(**kwargs)


def test_nonfinite_engine_logprobs_counted_within_the_loss_tokens():
    """``rollout/nonfinite_logprobs`` counts loss tokens whose engine logprob is NaN/inf; tokens past
    ``valid_lengths`` (masked) do not count."""
    batch = fake_batch([0], [True])
    batch.behaviour_logprobs = [torch.tensor([-0.5, float("nan"), -0.2]), torch.tensor([float("-inf"), float("nan")])]
    batch.valid_lengths = [3, 1]
    assert batch.num_nonfinite_logprobs() == 2
    batch.valid_lengths = [1, 0]
    assert batch.num_nonfinite_logprobs() == 0
