"""Unit tests for several weighted rewards (sum-then-normalise vs normalise-then-sum), None rewards, and the DAPO
overlong penalty."""

import math

import pytest
import torch

from grpo.advantages import compute_advantages, compute_multi_reward_advantages
from grpo.rewards import REWARD_FUNCTIONS, combine_rewards, overlong_penalty, register_reward_function

NAN = math.nan
G4 = torch.zeros(4, dtype=torch.int64)


def test_sum_then_normalise_hand_values():
    rewards = {"acc": torch.tensor([1.0, 0, 0, 0]), "fmt": torch.tensor([1.0, 1, 0, 0])}
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0, "fmt": 0.5}, G4, "grpo")
    # total [1.5, 0.5, 0, 0]: mean 0.5, unbiased std sqrt(1.5 / 3)
    torch.testing.assert_close(adv, torch.tensor([1.41421, 0.0, -0.70711, -0.70711]), atol=1e-4, rtol=0)
    same = compute_advantages(torch.tensor([1.5, 0.5, 0, 0]), G4, "grpo")
    torch.testing.assert_close(adv, same)


def test_normalise_then_sum_hand_values():
    rewards = {"acc": torch.tensor([1.0, 0, 0, 0]), "fmt": torch.tensor([1.0, 1, 0, 0])}
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0, "fmt": 0.5}, G4, "grpo",
                                          combine="normalise-then-sum")
    # acc → [1.5, −0.5, −0.5, −0.5]; fmt → ±0.5/sqrt(1/3) = ±0.86603, weighted 0.5
    expected = torch.tensor([1.5 + 0.43301, -0.5 + 0.43301, -0.5 - 0.43301, -0.5 - 0.43301])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_normalise_then_sum_all_equal_function_contributes_zero_and_weight_zero_ignored():
    rewards = {"acc": torch.tensor([1.0, 1, 1, 1]), "fmt": torch.tensor([1.0, 0, 0, 0]),
               "junk": torch.tensor([NAN, 5, 6, 7])}
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0, "fmt": 1.0, "junk": 0.0}, G4,
                                          combine="normalise-then-sum")
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    flat = compute_multi_reward_advantages({"acc": torch.ones(4)}, {"acc": 1.0}, G4, combine="normalise-then-sum")
    assert (flat == 0).all()


@pytest.mark.parametrize("combine", ["sum-then-normalise", "normalise-then-sum"])
def test_invalid_row_is_excluded_from_group_statistics(combine):
    """A row the caller marks invalid (no total: a weighted reward raised there) leaves every group statistic."""
    rewards = {"acc": torch.tensor([1.0, NAN, 0, 0]), "fmt": torch.tensor([1.0, 1, 1, 0])}
    valid = torch.tensor([True, False, True, True])
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0, "fmt": 1.0}, G4, combine=combine, valid=valid)
    assert adv[1].item() == 0.0 and torch.isfinite(adv).all()
    if combine == "normalise-then-sum":
        # acc over rows 0, 2, 3 = [1, 0, 0] and fmt = [1, 1, 0], each normalised alone
        torch.testing.assert_close(adv, torch.tensor([1.73205, 0.0, 0.0, -1.73205]), atol=1e-4, rtol=0)
    else:
        # totals over rows 0, 2, 3 = [2, 1, 0]: mean 1, std 1
        torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, 0.0, -1.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("combine", ["sum-then-normalise", "normalise-then-sum"])
def test_trl_convention_none_reward_does_not_apply_to_its_row(combine):
    """Issue 35: a None (NaN) reward where another weighted reward scores the row means "does not apply" (TRL):
    sum-then-normalise sums the rewards that apply (nansum); normalise-then-sum normalises each reward over the rows
    it scored (TRL's nanmean/nanstd per function) and adds nothing where it does not apply. A row no reward scores
    stays out."""
    rewards = {"acc": torch.tensor([1.0, NAN, 0, 0, NAN]), "fmt": torch.tensor([1.0, 1, 1, 0, NAN])}
    g5 = torch.zeros(5, dtype=torch.int64)
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0, "fmt": 1.0}, g5, combine=combine)
    assert adv[4].item() == 0.0 and torch.isfinite(adv).all()
    if combine == "normalise-then-sum":
        # acc over rows 0, 2, 3 = [1, 0, 0]: [1.1547, -, -0.5774, -0.5774]; fmt over rows 0-3 = [1, 1, 1, 0]: 0.5 each
        # above mean 0.75 / std 0.5 → [0.5, 0.5, 0.5, -1.5]
        expected = torch.tensor([1.1547 + 0.5, 0.5, -0.57735 + 0.5, -0.57735 - 1.5, 0.0])
        torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    else:
        # totals over rows 0-3 = [2, 1, 1, 0]: mean 1, unbiased std sqrt(2/3)
        expected = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.0]) / math.sqrt(2 / 3)
        torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("combine", ["sum-then-normalise", "normalise-then-sum"])
def test_group_without_any_valid_reward_gives_zero_not_nan(combine):
    rewards = {"acc": torch.tensor([NAN, NAN, 1.0, 0.0])}
    adv = compute_multi_reward_advantages(rewards, {"acc": 1.0}, torch.tensor([0, 0, 1, 1]), combine=combine)
    assert adv[:2].tolist() == [0.0, 0.0] and torch.isfinite(adv).all()


def test_multi_reward_validation():
    r = {"acc": torch.zeros(4)}
    with pytest.raises(ValueError, match="combine must be one of"):
        compute_multi_reward_advantages(r, {"acc": 1.0}, G4, combine="mean")
    with pytest.raises(ValueError, match="'fmt' but rewards hold only"):
        compute_multi_reward_advantages(r, {"fmt": 1.0}, G4)
    with pytest.raises(ValueError, match="must have shape"):
        compute_multi_reward_advantages({"acc": torch.zeros(3)}, {"acc": 1.0}, G4)
    with pytest.raises(ValueError, match="finite"):
        compute_multi_reward_advantages(r, {"acc": math.inf}, G4)


def test_wrong_count_names_function_expected_and_actual():
    register_reward_function("test_shaping_short")(lambda c, r: [1.0])
    try:
        with pytest.raises(ValueError, match=r"'test_shaping_short' returned 1 values, expected 3"):
            combine_rewards(["a", "b", "c"], ["1", "2", "3"], {"test_shaping_short": 1.0})
    finally:
        REWARD_FUNCTIONS.pop("test_shaping_short")


def test_overlong_penalty_dapo_hand_values():
    # L_max 20, L_cache 5: no penalty up to 15 tokens, linear to −1 at 20, −1 beyond.
    pen = overlong_penalty([10, 15, 16, 18, 20, 25], 20, 5, penalty_factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]), atol=1e-6, rtol=0)
    assert pen.dtype == torch.float32
    full = overlong_penalty(torch.tensor([4, 3, 2, 1]), 4, 4)
    torch.testing.assert_close(full, torch.tensor([-1.0, -0.75, -0.5, -0.25]))


@pytest.mark.parametrize("args, match", [((0, 1), "max_response_tokens"), ((4, 5), "buffer_tokens"),
                                         ((4, 0), "buffer_tokens")])
def test_overlong_penalty_validation(args, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty([1], *args)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty([1], 4, 2, -1.0)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty([-1], 4, 2)
