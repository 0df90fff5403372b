"""Unit tests for grpo.advantages: hand-computed values, group handling, NaN rows, exact zeros, registry."""

from typing import get_args

import pytest
import torch

from grpo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimatorName,
    all_equal_fraction,
    compute_advantages,
    compute_group_stats,
    group_all_equal_mask,
    register_advantage_estimator,
)

ESTIMATORS = list(get_args(AdvantageEstimatorName))


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.int64)


def test_registry_holds_exactly_the_literal_names():
    assert set(ADVANTAGE_ESTIMATORS) == set(ESTIMATORS)


def test_grpo_one_correct_out_of_eight():
    rewards = t([0.0] + [0.95] * 7)
    adv = compute_advantages(rewards, ids([0] * 8), "grpo", eps=1e-6, std="unbiased")
    assert adv.dtype == torch.float32 and adv.shape == (8,)
    torch.testing.assert_close(adv[0], torch.tensor(-2.47487), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[1:], torch.full((7,), 0.35355), atol=1e-4, rtol=0)


def test_grpo_unbiased_and_rloo_hand_values():
    rewards, groups = t([1.0, 0.0, 0.0, 0.0]), ids([0, 0, 0, 0])
    grpo = compute_advantages(rewards, groups, "grpo")
    torch.testing.assert_close(grpo, t([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    rloo = compute_advantages(rewards, groups, "rloo")
    torch.testing.assert_close(rloo, t([1.0, -1 / 3, -1 / 3, -1 / 3]), atol=1e-6, rtol=0)


def test_grpo_biased_std():
    # mean 0.25, biased var = 3/16 -> std = sqrt(3)/4
    adv = compute_advantages(t([1.0, 0.0, 0.0, 0.0]), ids([0, 0, 0, 0]), "grpo", std="biased", eps=0.0)
    s = 3**0.5 / 4
    torch.testing.assert_close(adv, t([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]), atol=1e-6, rtol=0)


def test_dr_grpo_uneven_groups_and_shuffle_invariance():
    rewards = t([1, 2, 3, 4, 10, 12, 5, 6, 7])
    groups = ids([0, 0, 0, 0, 1, 1, 2, 2, 2])
    expected = t([-1.5, -0.5, 0.5, 1.5, -1, 1, -1, 0, 1])
    adv = compute_advantages(rewards, groups, "dr_grpo")
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    gen = torch.Generator().manual_seed(0)
    for estimator in ESTIMATORS:
        base = compute_advantages(rewards, groups, estimator)
        for _ in range(3):
            perm = torch.randperm(9, generator=gen)
            shuffled = compute_advantages(rewards[perm], groups[perm], estimator)
            torch.testing.assert_close(shuffled, base[perm], atol=0, rtol=0)


def test_arbitrary_group_ids_equal_dense_ids():
    rewards = t([1, 2, 3, 4, 10, 12, 5, 6, 7])
    dense = ids([0, 0, 0, 0, 1, 1, 2, 2, 2])
    sparse = ids([1000, 1000, 1000, 1000, -7, -7, 2**40, 2**40, 2**40])
    for estimator in ESTIMATORS:
        expected = compute_advantages(rewards, dense, estimator)
        torch.testing.assert_close(compute_advantages(rewards, sparse, estimator), expected, atol=0, rtol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.95, -3.7, 12345.678, 1e-30])
def test_all_equal_group_is_exactly_zero(estimator, value):
    rewards = t([value] * 7 + [0.0, 1.0])
    groups = ids([0] * 7 + [1, 1])
    adv = compute_advantages(rewards, groups, estimator)
    assert (adv[:7] == 0.0).all()
    assert (adv[7:] != 0.0).all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_size_one_groups_and_invalid_rows_are_zero(estimator):
    nan = float("nan")
    rewards = t([5.0, nan, 1.0, nan, 3.0, 1.0, 0.0])
    groups = ids([0, 1, 1, 2, 2, 3, 3])  # g0 size 1; g1, g2 one valid; g3 normal
    adv = compute_advantages(rewards, groups, estimator)
    assert torch.isfinite(adv).all()
    assert (adv[:5] == 0.0).all()
    assert adv[5] > 0 and adv[6] < 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_nan_rows_are_excluded_from_group_statistics(estimator):
    nan = float("nan")
    with_nan = compute_advantages(t([1.0, nan, 0.0, 0.0, nan, 0.0]), ids([0] * 6), estimator)
    without = compute_advantages(t([1.0, 0.0, 0.0, 0.0]), ids([0] * 4), estimator)
    assert with_nan[1] == 0.0 and with_nan[4] == 0.0
    torch.testing.assert_close(with_nan[[0, 2, 3, 5]], without, atol=0, rtol=0)


def test_all_nan_group_is_zero():
    adv = compute_advantages(t([float("nan")] * 3 + [1.0, 2.0]), ids([0, 0, 0, 1, 1]))
    assert (adv[:3] == 0.0).all() and torch.isfinite(adv).all()


def test_two_pass_statistics_are_stable_for_large_offsets():
    # float32-representable rewards with a huge common offset: E[x^2] - E[x]^2 would lose all precision.
    rewards = t([1e6, 1e6 + 0.5, 1e6 + 1.0])
    adv = compute_advantages(rewards, ids([0, 0, 0]), "grpo", eps=0.0)
    torch.testing.assert_close(adv, t([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    stats = compute_group_stats(rewards, ids([0, 0, 0]))
    assert stats.sq_dev_sum.item() == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_random_batches_never_nan_or_inf(estimator):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (300,), generator=gen).float()
    rewards[torch.rand(300, generator=gen) < 0.1] = float("nan")
    groups = torch.randint(0, 120, (300,), generator=gen)
    adv = compute_advantages(rewards, groups, estimator, eps=0.0)
    assert torch.isfinite(adv).all()


def test_group_means_of_advantages_are_zero():
    gen = torch.Generator().manual_seed(2)
    rewards = torch.rand(40, generator=gen)
    groups = torch.randint(0, 5, (40,), generator=gen)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        adv = compute_advantages(rewards, groups, estimator).double()
        sums = torch.zeros(5, dtype=torch.float64).index_add(0, groups, adv)
        torch.testing.assert_close(sums, torch.zeros(5, dtype=torch.float64), atol=1e-5, rtol=0)


def test_rloo_equals_leave_one_out_definition():
    rewards = t([0.3, 0.9, 0.1, 0.5, 0.2])
    adv = compute_advantages(rewards, ids([0] * 5), "rloo")
    expected = torch.stack([rewards[i] - (rewards.sum() - rewards[i]) / 4 for i in range(5)])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_empty_batch():
    adv = compute_advantages(t([]), ids([]))
    assert adv.shape == (0,) and adv.dtype == torch.float32
    assert all_equal_fraction(t([]), ids([])) == 0.0


def test_all_equal_mask_and_fraction():
    rewards = t([1.0, 1.0, 0.0, 1.0, 5.0, float("nan"), 2.0])
    groups = ids([7, 7, 3, 3, 9, 11, 11])  # sorted ids: 3 (not equal), 7 (equal), 9 (size 1), 11 (one valid)
    assert group_all_equal_mask(rewards, groups).tolist() == [False, True, True, True]
    assert all_equal_fraction(rewards, groups) == pytest.approx(0.75)


@pytest.mark.parametrize(
    "rewards, groups, match",
    [
        (t([[1.0]]), ids([0]), "1-D"),
        (t([1.0, 2.0]), ids([0]), "same length"),
        (t([1.0, 2.0]), t([0.0, 0.0]), "integer"),
        (t([1.0, float("inf")]), ids([0, 0]), "Inf"),
        (ids([1, 0]), ids([0, 0]), "floating-point"),
    ],
)
def test_input_validation(rewards, groups, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, groups)


def test_unknown_estimator_and_std_raise():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(t([1.0]), ids([0]), "ppo")
    with pytest.raises(ValueError, match="std must be one of"):
        compute_advantages(t([1.0]), ids([0]), std="population")


def test_register_custom_estimator_and_duplicate_raises():
    @register_advantage_estimator("test_sign")
    def _sign(rewards, stats, *, eps, std):
        return torch.sign(rewards - stats.mean[stats.group_index])

    try:
        adv = compute_advantages(t([3.0, 1.0, 2.0, 2.0]), ids([0, 0, 1, 1]), "test_sign")
        assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_sign")(_sign)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("grpo")(_sign)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_sign")
