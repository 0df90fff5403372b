"""The ``algorithm`` spec section: defaults keep the demo's GRPO, every option validates, cross-field checks."""

from pathlib import Path

import pytest

from cluster.spec.algorithm import AlgorithmSpec
from cluster.spec import SpecError, load_spec_text, spec_to_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MINIMAL = """\
output_dir: runs/test
total_steps: 3
data:
  train_path: train.jsonl
rollout:
  max_response_tokens: 64
"""


def load(*overrides: str):
    return load_spec_text(MINIMAL, source="job.yaml", overrides=overrides)


def test_defaults_are_the_demos_grpo():
    alg = load().algorithm
    assert (alg.advantage_estimator, alg.loss_agg, alg.kl_estimator, alg.kl_coef) == (
        "grpo", "seq-mean-token-mean", "k3", 0.04)
    assert (alg.kl_in_reward, alg.kl_controller, alg.num_iterations) == (False, "fixed", 1)
    assert alg.dual_clip_c is None and alg.tis_cap is None and alg.overlong_buffer_tokens is None
    assert (alg.mask_truncated, alg.dynamic_sampling, alg.group_size_schedule, alg.group_size_max) == (
        False, False, (), None)
    assert (alg.reward_combine, alg.reward_on_error) == ("sum-then-normalise", "raise")
    for path in (EXAMPLES / "gsm8k_smollm2_cpu.yaml", EXAMPLES.parent / "tests" / "tiny_cpu.yaml"):
        demo = load_spec_text(path.read_text(), source=path.name).algorithm
        assert demo.model_dump(exclude={"rewards"}) == AlgorithmSpec().model_dump(exclude={"rewards"})


def test_every_option_is_selectable_and_round_trips():
    spec = load("algorithm.dual_clip_c=3", "algorithm.kl_in_reward=true", "algorithm.kl_controller=adaptive",
                "algorithm.kl_target=0.02", "algorithm.kl_horizon_sequences=5000", "algorithm.tis_cap=2",
                "algorithm.mask_truncated=true", "algorithm.overlong_buffer_tokens=16",
                "algorithm.overlong_penalty_factor=0.5", "algorithm.reward_combine=normalise-then-sum",
                "algorithm.reward_on_error=none", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4",
                "algorithm.group_size_schedule=[[1, 8], [50, 16]]", "algorithm.group_size_max=32",
                "algorithm.group_size_rise_threshold=0.75", "algorithm.entropy_coef=0.001",
                "algorithm.num_iterations=2", "algorithm.advantage_estimator=rloo", "algorithm.loss_agg=token-mean",
                "algorithm.clip_eps_high=0.28")
    alg = spec.algorithm
    assert alg.group_size_schedule == ((1, 8), (50, 16)) and alg.dual_clip_c == 3.0 and alg.tis_cap == 2.0
    assert load_spec_text(spec_to_yaml(spec)) == spec


@pytest.mark.parametrize("override, message", [
    ("algorithm.dual_clip_c=1", r"algorithm.dual_clip_c: Input should be greater than 1"),
    ("algorithm.tis_cap=0", r"algorithm.tis_cap: Input should be greater than 0"),
    ("algorithm.num_iterations=0", r"algorithm.num_iterations: Input should be greater than or equal to 1"),
    ("algorithm.max_sampling_rounds=0", r"algorithm.max_sampling_rounds: Input should be greater than or equal"),
    ("algorithm.kl_controller=pid", r"algorithm.kl_controller: Input should be 'fixed' or 'adaptive'"),
    ("algorithm.reward_combine=mean", r"algorithm.reward_combine: Input should be 'sum-then-normalise' or"),
    ("algorithm.reward_on_error=skip", r"algorithm.reward_on_error: Input should be 'raise' or 'none'"),
    ("algorithm.group_size_schedule=[[5, 8], [5, 16]]", r"steps >= 1 strictly increasing, got steps \[5, 5\]"),
    ("algorithm.group_size_schedule=[[1, 1]]", r"expected every G >= 2"),
    ("algorithm.group_size_rise_threshold=0", r"group_size_rise_threshold: Input should be greater than 0"),
    ("algorithm.overlong_buffer_tokens=65", r"algorithm.overlong_buffer_tokens: expected overlong_buffer_tokens "
                                            r"<= rollout.max_response_tokens = 64, got 65"),
    ("algorithm.group_size_max=3", r"algorithm.group_size_max: expected group_size_max >= .* = 4, got 3"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(SpecError, match=message):
        load(override)


@pytest.mark.parametrize("option", ["algorithm.kl_controller=adaptive", "algorithm.kl_in_reward=true"])
def test_kl_options_need_a_kl_coef(option):
    message = r"--set (algorithm.\w+): .* needs algorithm.kl_coef > 0 \(the initial beta\), got 0"
    with pytest.raises(SpecError, match=message):
        load(option, "algorithm.kl_coef=0")
    load(option)


def test_group_size_max_counts_the_schedule():
    with pytest.raises(SpecError, match=r"group_size_max >= .* = 16, got 8"):
        load("algorithm.group_size_schedule=[[10, 16]]", "algorithm.group_size_max=8")
    assert load("algorithm.group_size_schedule=[[10, 16]]", "algorithm.group_size_max=16").algorithm.group_size_max


def test_group_size_below_two_is_impossible():
    with pytest.raises(SpecError, match=r"rollout.group_size: Input should be greater than or equal to 2"):
        load("rollout.group_size=1")


@pytest.mark.parametrize("override, message", [
    ("algorithm.num_iterations=true", r"--set algorithm.num_iterations: Input should be a "
                                      r"valid integer \(got True\)"),
    ("algorithm.num_iterations='2'", r"algorithm.num_iterations: Input should be a valid integer \(got '2'\)"),
    ("algorithm.max_sampling_rounds=2.0", r"algorithm.max_sampling_rounds: Input should be a valid integer"),
    ("algorithm.kl_horizon_sequences=true", r"algorithm.kl_horizon_sequences: Input should be a valid integer"),
    ("algorithm.overlong_buffer_tokens='16'", r"algorithm.overlong_buffer_tokens: Input should be a valid integer"),
    ("algorithm.group_size_max=true", r"algorithm.group_size_max: Input should be a valid integer"),
    ("algorithm.group_size_schedule=[[true, 8]]", r"algorithm.group_size_schedule.0.0: Input should be a valid "
                                                  r"integer"),
    ("algorithm.group_size_schedule=[[1, '8']]", r"algorithm.group_size_schedule.0.1: Input should be a valid "
                                                 r"integer"),
])
def test_integer_options_are_strict(override, message):
    with pytest.raises(SpecError, match=message):
        load(override)


@pytest.mark.parametrize("override, message", [
    ("algorithm.group_size_max=1025", r"algorithm.group_size_max: Input should be less than or equal to 1024"),
    ("algorithm.group_size_schedule=[[1, 1025]]", r"expected every G >= 2 .* and <= 1024, got \[1025\]"),
    ("algorithm.num_iterations=1025", r"algorithm.num_iterations: Input should be less than or equal to 1024"),
    ("algorithm.max_sampling_rounds=1025", r"algorithm.max_sampling_rounds: Input should be less than or equal"),
])
def test_group_sizes_and_iterations_have_upper_bounds(override, message):
    with pytest.raises(SpecError, match=message):
        load(override)
    assert load("algorithm.group_size_max=1024", "algorithm.group_size_schedule=[[1, 1024]]",
                "algorithm.num_iterations=1024").algorithm.group_size_max == 1024


@pytest.mark.parametrize("name", ["mean", "std", "failed", "none_fraction", "infra_failed", "not_applicable",
                                  "overlong_penalty"])
def test_reserved_reward_names_refused_at_spec_load(name):
    with pytest.raises(SpecError) as info:
        load(f'algorithm.rewards={{"{name}": 1.0}}')
    message = (f"reward name '{name}' is reserved: reward/{name} is a metric the driver reports "
               f"(reserved: failed, infra_failed, mean, none_fraction, not_applicable, overlong_penalty, std); rename "
               f"the function")
    assert f"--set algorithm.rewards: {message}" in str(info.value)
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + f"algorithm:\n  rewards:\n    accuracy: 1.0\n    {name}: 0.5\n", source="job.yaml")
    assert f"job.yaml:8: algorithm.rewards: {message}" in str(info.value)
