"""Unit tests for grpo.rewards: the reward-function registry and combine_rewards."""

import math
from typing import get_args

import pytest
import torch

from grpo.rewards import (
    REWARD_FUNCTIONS,
    CombinedRewards,
    RewardFunctionName,
    combine_rewards,
    register_reward_function,
)

# A worked right answer, a bare right answer, a worked wrong answer, nothing (format: 1, 0, 1, 0).
COMPLETIONS = ["Natalia sold 48/2 = 24 clips in May and 48 + 24 = 72 in all.\n#### 72", "The answer is 72",
               "3 bags of 2 apples is 3 * 2 = 6 apples; 1 was eaten.\n#### 5", "nothing"]
REFERENCES = ["... #### 72", "72", "... #### 6", "#### 1"]


@pytest.fixture
def temp_reward():
    """Register reward functions under test names and remove them afterwards."""
    added = []

    def add(name, fn):
        register_reward_function(name)(fn)
        added.append(name)

    yield add
    for name in added:
        REWARD_FUNCTIONS.pop(name)


def test_registry_holds_the_literal_names():
    assert set(get_args(RewardFunctionName)) <= set(REWARD_FUNCTIONS)
    with pytest.raises(ValueError, match="already registered"):
        register_reward_function("accuracy")(lambda c, r: [])


def test_builtin_batch_functions():
    assert REWARD_FUNCTIONS["accuracy"](COMPLETIONS, REFERENCES) == [1.0, 1.0, 0.0, 0.0]
    assert REWARD_FUNCTIONS["format"](COMPLETIONS, REFERENCES) == [1.0, 0.0, 1.0, 0.0]


def test_weighted_sum_and_per_function():
    result = combine_rewards(COMPLETIONS, REFERENCES, {"accuracy": 1.0, "format": 0.25})
    assert isinstance(result, CombinedRewards)
    total, per_function, num_failed = result
    assert total.dtype == torch.float32 and total.shape == (4,)
    torch.testing.assert_close(total, torch.tensor([1.25, 1.0, 0.25, 0.0]))
    assert per_function["format"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert num_failed == {"accuracy": 0, "format": 0}


def test_zero_weight_runs_but_stays_out_of_total(temp_reward):
    temp_reward("test_all_none", lambda c, r: [None] * len(c))
    total, per_function, _ = combine_rewards(COMPLETIONS, REFERENCES, {"format": 1.0, "test_all_none": 0.0})
    torch.testing.assert_close(total, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert torch.isnan(per_function["test_all_none"]).all()


def test_trl_convention_none_leaves_the_reward_out_of_the_sum_where_another_scores_the_row(temp_reward):
    """Issue 35: None (or NaN) means "this reward does not apply to this row" when another weighted reward scores it:
    the total is the weighted sum over the rewards that apply (TRL's nansum); a row no weighted reward scores has no
    total (an infrastructure failure)."""
    temp_reward("test_partial", lambda c, r: [0.5, None, float("nan"), 2])
    total, per_function, _ = combine_rewards(COMPLETIONS, REFERENCES, {"format": 1.0, "test_partial": 2.0})
    assert total.tolist() == [2.0, 0.0, 1.0, 4.0]  # format [1, 0, 1, 0] + 2 x [0.5, -, -, 2]
    assert math.isnan(per_function["test_partial"][1].item())
    temp_reward("test_none_where_format_is_zero", lambda c, r: [None, None, 1.0, None])
    total, _, _ = combine_rewards(COMPLETIONS, REFERENCES, {"test_partial": 1.0, "test_none_where_format_is_zero": 1.0})
    assert total[0].item() == 0.5 and total[2].item() == 1.0 and total[3].item() == 2.0
    assert math.isnan(total[1].item())  # None from both: nothing scored it


def test_wrong_count_raises_naming_function_and_counts(temp_reward):
    temp_reward("test_short", lambda c, r: [1.0] * (len(c) - 1))
    for on_error in ("raise", "none"):
        with pytest.raises(ValueError, match=r"'test_short' returned 3 values, expected 4"):
            combine_rewards(COMPLETIONS, REFERENCES, {"test_short": 1.0}, on_error=on_error)


def test_non_numeric_values_raise(temp_reward):
    temp_reward("test_str", lambda c, r: ["1.0"] * len(c))
    with pytest.raises(ValueError, match="'test_str' returned str at row 0"):
        combine_rewards(COMPLETIONS, REFERENCES, {"test_str": 1.0})


def test_raising_function(temp_reward):
    def boom(c, r):
        raise KeyError("grader down")

    temp_reward("test_boom", boom)
    with pytest.raises(RuntimeError, match="'test_boom' raised KeyError") as info:
        combine_rewards(COMPLETIONS, REFERENCES, {"format": 1.0, "test_boom": 1.0})
    assert isinstance(info.value.__cause__, KeyError)
    total, per_function, num_failed = combine_rewards(
        COMPLETIONS, REFERENCES, {"format": 1.0, "test_boom": 1.0}, on_error="none"
    )
    assert torch.isnan(total).all() and torch.isnan(per_function["test_boom"]).all()
    assert per_function["format"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert num_failed == {"format": 0, "test_boom": 4}


def test_bad_reference_raises_through_accuracy():
    with pytest.raises(RuntimeError, match="'accuracy' raised ValueError"):
        combine_rewards(["#### 1"], ["no number"], {"accuracy": 1.0})


@pytest.mark.parametrize(
    "completions, references, weights, kwargs, match",
    [
        (["a"], ["1", "2"], {"format": 1.0}, {}, "1 completions but 2 references"),
        (["a"], ["1"], {}, {}, "at least one"),
        (["a"], ["1"], {"bleu": 1.0}, {}, "unknown reward function 'bleu'"),
        (["a"], ["1"], {"format": float("inf")}, {}, "must be finite"),
        (["a"], ["1"], {"format": 1.0}, {"on_error": "skip"}, "on_error"),
    ],
)
def test_validation(completions, references, weights, kwargs, match):
    with pytest.raises(ValueError, match=match):
        combine_rewards(completions, references, weights, **kwargs)


def test_empty_batch():
    total, per_function, _ = combine_rewards([], [], {"accuracy": 1.0})
    assert total.shape == (0,) and per_function["accuracy"].shape == (0,)


RESERVED = ["mean", "std", "failed", "none_fraction", "infra_failed", "not_applicable", "overlong_penalty"]


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_names_refused_at_registration(name):
    """Issue #12: a reward function named ``mean`` overwrote ``reward/mean`` (read by the alerts)."""
    with pytest.raises(ValueError, match=rf"reward function name '{name}' is reserved: the driver reports "
                                         rf"reward/{name} .*reserved names: failed, infra_failed, mean, "
                                         rf"none_fraction, not_applicable, overlong_penalty, std"):
        register_reward_function(name)(lambda c, r: [1.0] * len(c))
    with pytest.raises(ValueError, match="is reserved"):
        REWARD_FUNCTIONS[name] = lambda c, r: [1.0] * len(c)
    assert name not in REWARD_FUNCTIONS


def test_reserved_names_are_the_summary_metrics_the_driver_emits():
    """One source of truth: the reserved set is what `reward_metrics` (used by the driver) writes besides one key per
    component, plus the driver's overlong-penalty component."""
    from cluster.loop import scoring, step_metrics
    from grpo.rewards import OVERLONG_PENALTY_KEY, RESERVED_REWARD_NAMES, reward_metrics

    total = torch.tensor([1.0, math.nan, 0.0, 0.5])
    per_function = {"accuracy": torch.tensor([1.0, math.nan, 0.0, 0.0]), "format": torch.tensor([0.0, 0.0, 0.0, 1.0])}
    metrics = reward_metrics(total, per_function, 2)
    # row 1 has no total (an infrastructure failure): it is left out of every figure but the counts, format's too
    assert metrics == {"reward/accuracy": pytest.approx(1 / 3), "reward/format": pytest.approx(1 / 3),
                       "reward/mean": 0.5, "reward/std": 0.5, "reward/failed": 2, "reward/none_fraction": 0.25,
                       "reward/infra_failed": 1, "reward/not_applicable": 0, "reward/scored/accuracy": 3,
                       "reward/scored/format": 3}
    summaries = {k.removeprefix("reward/") for k in metrics if k.count("/") == 1} - set(per_function)
    assert RESERVED_REWARD_NAMES == summaries | {OVERLONG_PENALTY_KEY} == set(RESERVED)
    assert scoring.OVERLONG == OVERLONG_PENALTY_KEY and step_metrics.reward_metrics is reward_metrics
    with pytest.raises(ValueError, match=r"would overwrite the summary metrics reward/mean"):
        reward_metrics(total, {"mean": total}, 0)


@pytest.mark.parametrize("name", ["none-fraction", "none fraction", "none.fraction", "overlong-penalty",
                                  "overlong/penalty"])
def test_names_that_are_a_reserved_metric_in_prometheus_are_refused(name):
    """``reward/none-fraction`` is the Prometheus series grpo_reward_none_fraction
    (cluster.sinks.metric_names.prometheus_name), the driver's own; the gauge would be overwritten as for
    ``none_fraction`` itself."""
    from cluster.sinks.metric_names import prometheus_name

    reserved = name.replace("-", "_").replace(" ", "_").replace(".", "_").replace("/", "_")
    assert prometheus_name(f"reward/{name}") == prometheus_name(f"reward/{reserved}")
    with pytest.raises(ValueError, match=rf"reward function name '{name}' is reserved \(the same name as "
                                         rf"'{reserved}' once used as a metric name\): the driver reports"):
        register_reward_function(name)(lambda c, r: [1.0] * len(c))
    assert name not in REWARD_FUNCTIONS


def test_two_functions_with_one_prometheus_name_are_refused():
    before = dict(REWARD_FUNCTIONS)
    try:
        register_reward_function("tmp_len_penalty")(lambda c, r: [0.0] * len(c))
        with pytest.raises(ValueError, match=r"'tmp-len-penalty' is the same name as the registered 'tmp_len_penalty' "
                                             r"once used as a metric name \('tmp_len_penalty'\)"):
            register_reward_function("tmp-len-penalty")(lambda c, r: [1.0] * len(c))
        register_reward_function("TMP_len_penalty")(lambda c, r: [1.0] * len(c))  # another series: case counts
    finally:
        for name in set(REWARD_FUNCTIONS) - set(before):
            dict.__delitem__(REWARD_FUNCTIONS, name)
    assert dict(REWARD_FUNCTIONS) == before
