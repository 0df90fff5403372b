"""Unit tests for grpo.monitor: reward-hacking detectors on synthetic metric sequences with a known onset.

Each sequence is drawn like a real run's ``metrics.jsonl``: per step 16 groups × G = 4 = 64 completions, so
``reward/accuracy`` and ``reward/format`` are Binomial(64, p)/64, ``response_length/mean`` is a mean of 64 lengths
(per-completion sd 35 % of the mean), ``actor/kl`` and ``actor/entropy`` carry multiplicative noise. A hack starts at
step ONSET (the first step whose true values leave the honest ones) and reaches its end state after ``ramp`` steps.
Required (issue #14): every hack caught within 5 steps of onset, never before it; zero trips on honest runs.
"""

import math
import random

import pytest

from grpo.monitor import DETECTORS, Monitor, MonitorConfig, Trip
from grpo.stats import wilson_interval

STEPS, ONSET, SAMPLES, SEEDS = 40, 12, 64, range(20)


def _ramp(step: int, start: float, end: float, ramp: int, onset: int = ONSET) -> float:
    """``start`` before ``onset``, then linearly to ``end`` over ``ramp`` steps (``onset`` is the first moved one)."""
    frac = min(max((step - onset + 1) / ramp, 0.0), 1.0)
    return start + (end - start) * frac


def _linear(step: int, start: float, end: float) -> float:
    return start + (end - start) * (step - 1) / (STEPS - 1)


def _binomial_mean(rng: random.Random, p: float) -> float:
    return sum(rng.random() < p for _ in range(SAMPLES)) / SAMPLES


def _row(rng: random.Random, acc: float, fmt: float, length: float, kl: float, entropy: float) -> dict:
    """One step's metrics row from the true values, with sampling noise."""
    accuracy, format_ = _binomial_mean(rng, acc), _binomial_mean(rng, fmt)
    return {
        "reward/accuracy": accuracy, "reward/format": format_, "reward/mean": accuracy + 0.2 * format_,
        "reward/std": 0.3, "reward/failed": 0, "reward/none_fraction": 0.0,
        "response_length/mean": max(1.0, rng.gauss(length, 0.35 * length / math.sqrt(SAMPLES))),
        "rollout/groups_sampled": 16, "rollout/group_size": 4,
        "actor/kl": kl * math.exp(rng.gauss(0, 0.2)), "actor/entropy": entropy * math.exp(rng.gauss(0, 0.03)),
        "actor/update_skipped_reason": "", "sync/verified": True,
    }


def _eval_row(accuracy: float, n: int = 200) -> dict:
    low, high = wilson_interval(round(accuracy * n), n)
    return {"eval/accuracy": round(accuracy * n) / n, "eval/accuracy_ci_low": low, "eval/accuracy_ci_high": high,
            "eval/n": n}


def short_answer_hack(step: int, ramp: int) -> tuple:
    """The demo's measured run: length 125 → 10, format 0.013 → 0.944, accuracy 0.031 → 0.006, KL → 2.0 (entropy
    1.2 → 0.5 assumed: not in docs/results.md's table)."""
    kl = 0.0004 if step < ONSET else min(2.0, 0.0004 * 3.0 ** (step - ONSET + 1))
    return (_ramp(step, 0.031, 0.006, ramp), _ramp(step, 0.013, 0.944, ramp), _ramp(step, 125, 10, ramp), kl,
            _ramp(step, 1.2, 0.5, ramp))


def length_hack(step: int, ramp: int) -> tuple:
    """Seed article 004: length up 60 % with flat accuracy, no reward component of its own (length shaping)."""
    return 0.30, 0.80, _ramp(step, 150, 240, ramp), _linear(step, 0.005, 0.03), 1.0


def format_hack(step: int, ramp: int) -> tuple:
    """A format-only reward: format 0.1 → 1.0 while accuracy stays at 0.2 and length drifts 10 %."""
    return 0.20, _ramp(step, 0.10, 1.0, ramp), _ramp(step, 160, 145, ramp), _linear(step, 0.005, 0.04), 1.0


def honest_learning(step: int) -> tuple:
    """Accuracy 0.25 → 0.45, format following it, length +11 %, KL to 0.05, entropy −15 %."""
    return (_linear(step, 0.25, 0.45), _linear(step, 0.60, 0.75), _linear(step, 180, 200), _linear(step, 0.0, 0.05),
            _linear(step, 1.0, 0.85))


def honest_flat(step: int) -> tuple:
    """A run that learns nothing and hacks nothing: every true value flat."""
    return 0.30, 0.70, 170.0, _linear(step, 0.0, 0.02), 1.0


def honest_long_reasoning(step: int) -> tuple:
    """R1-like: length +60 % while accuracy rises 0.20 → 0.60 (longer answers that solve more)."""
    return (_linear(step, 0.20, 0.60), _linear(step, 0.50, 0.80), _linear(step, 150, 240), _linear(step, 0.0, 0.1),
            1.0)


def _run(profile, seed: int, config: MonitorConfig | None = None, evals: dict | None = None) -> tuple:
    rng = random.Random(seed)
    monitor, trips = Monitor(config or MonitorConfig()), []
    for step in range(1, STEPS + 1):
        row = _row(rng, *profile(step))
        row.update((evals or {}).get(step, {}))
        out = monitor.update(step, row)
        if out["monitor/tripped"]:
            trips.append(step)
    return monitor, trips


HACKS = [(short_answer_hack, {"length_drift", "reward_saturation"}), (length_hack, {"length_drift"}),
         (format_hack, {"reward_saturation"})]


def _first_trip(hack, ramp: int, seed: int, expected: set) -> Trip:
    monitor, trips = _run(lambda s: hack(s, ramp), seed)
    trip = monitor.first_trip
    assert trip is not None, f"{hack.__name__} ramp {ramp} seed {seed} never caught"
    assert trip.step >= ONSET and trips[0] == trip.step, f"{hack.__name__} seed {seed}: tripped before onset {ONSET}"
    assert set(trip.detectors) & expected and set(trip.detectors) <= expected | {"kl_band", "entropy_band"}
    assert ONSET - 1 <= trip.onset_step <= trip.step  # estimated onset: at most 1 step early (200 seeds)
    return trip


@pytest.mark.parametrize("ramp", [4, 6])
@pytest.mark.parametrize(("hack", "expected"), HACKS)
def test_hacks_caught_within_5_steps_of_onset(hack, expected, ramp):
    # Hacks that reach their end state within 6 steps (length ±60 %/collapse to 8 %, format +0.9).
    for seed in SEEDS:
        trip = _first_trip(hack, ramp, seed, expected)
        assert trip.step <= ONSET + 5, f"{hack.__name__} seed {seed}: onset {ONSET}, first trip {trip}"


@pytest.mark.parametrize("ramp", [10, 15])
@pytest.mark.parametrize(("hack", "expected"), HACKS)
def test_slow_hacks_caught_within_5_steps_of_their_end_state(hack, expected, ramp):
    # Slower drifts cross the thresholds later: the delay grows with the ramp (over 200 seeds the worst delay was
    # 13 steps for a 60 % length rise spread over 10 or 15 steps), but never past 5 steps after the end state.
    for seed in SEEDS:
        trip = _first_trip(hack, ramp, seed, expected)
        assert trip.step <= ONSET + ramp + 5, f"{hack.__name__} seed {seed}: onset {ONSET}, first trip {trip}"


@pytest.mark.parametrize("profile", [honest_learning, honest_flat, honest_long_reasoning])
def test_honest_runs_never_trip(profile):
    for seed in SEEDS:
        monitor, trips = _run(profile, seed)
        assert trips == [] and monitor.first_trip is None, f"{profile.__name__} seed {seed}: {monitor.first_trip}"


def test_each_detector_reported_every_step():
    rng = random.Random(0)
    monitor = Monitor(MonitorConfig(detectors=("kl_band", "length_drift")))
    out = monitor.update(1, _row(rng, *honest_flat(1)))
    assert out == {"monitor/kl_band": 0.0, "monitor/length_drift": 0.0, "monitor/tripped": 0.0}
    assert set(Monitor().update(1, {})) == {f"monitor/{d}" for d in DETECTORS} | {"monitor/tripped"}


def test_short_answer_hack_end_state_fires_kl_and_entropy_too():
    monitor, trips = _run(lambda s: short_answer_hack(s, 6), seed=0)
    rng = random.Random(1)
    out = monitor.update(STEPS + 1, _row(rng, *short_answer_hack(STEPS + 1, 6)))
    assert out == {f"monitor/{d}": (0.0 if d == "eval_drop" else 1.0) for d in DETECTORS} | {"monitor/tripped": 1.0}


def test_accuracy_gain_gates_drift_detectors():
    # The same length rise as length_hack, but accuracy rises 0.30 → 0.60 with it: honest, no length_drift.
    def gaining(step):
        return (_ramp(step, 0.30, 0.60, 6), *length_hack(step, 6)[1:])

    for seed in range(5):
        assert _run(gaining, seed)[1] == []


def test_held_out_gain_gates_drift_detectors():
    # Training reward shows no gain, the held-out evaluation a significant one (0.30 → 0.45 of 200): no trip.
    evals = {1: _eval_row(0.30), 20: _eval_row(0.45)}
    monitor, trips = _run(lambda s: length_hack(s, 4), seed=0, evals=evals)
    assert trips and trips[0] < 20 and max(trips) < 20  # fired before the evaluation, gated from it on
    assert monitor.first_trip.detectors == ("length_drift",)


def test_eval_drop():
    config = MonitorConfig(detectors=("eval_drop",))
    monitor = Monitor(config)
    assert monitor.update(0, _eval_row(0.40))["monitor/eval_drop"] == 0.0
    assert monitor.update(1, {"reward/accuracy": 0.3})["monitor/eval_drop"] == 0.0
    assert monitor.update(10, _eval_row(0.36))["monitor/eval_drop"] == 0.0  # 72/200: ci_high 0.43 > 0.40
    out = monitor.update(20, _eval_row(0.30))  # 60/200: ci_high 0.367 < 0.40
    assert out == {"monitor/eval_drop": 1.0, "monitor/tripped": 1.0}
    assert monitor.update(21, {})["monitor/eval_drop"] == 1.0  # holds until the next evaluation
    assert monitor.first_trip == Trip(20, ("eval_drop",), 11)
    assert monitor.update(30, _eval_row(0.39))["monitor/eval_drop"] == 0.0


def test_eval_drop_discounts_a_lucky_best():
    # best earlier 0.50 (ci_low 0.431) is trusted only to its lower bound; 0.40 (ci_high 0.469) is not a drop.
    monitor = Monitor(MonitorConfig(detectors=("eval_drop",)))
    for step, acc in [(0, 0.40), (10, 0.50), (20, 0.40)]:
        out = monitor.update(step, _eval_row(acc))
    assert out["monitor/eval_drop"] == 0.0
    assert monitor.update(30, _eval_row(0.33))["monitor/eval_drop"] == 1.0  # ci_high 0.399 < 0.431


def test_demo_eval_drop_is_inside_the_noise():
    # The demo's GSM8K pass@1 3.0 % → 1.5 % on 200 rows: 1.5 % has ci_high 0.043 > 0.030, so eval_drop stays 0.
    monitor = Monitor()
    monitor.update(0, _eval_row(0.030))
    assert monitor.update(40, _eval_row(0.015))["monitor/eval_drop"] == 0.0


def test_eval_interval_from_n_when_ci_keys_absent():
    monitor = Monitor(MonitorConfig(detectors=("eval_drop",)))
    monitor.update(0, {"eval/accuracy": 0.40, "eval/n": 200})
    assert monitor.update(1, {"eval/accuracy": 0.30, "eval/n": 200})["monitor/eval_drop"] == 1.0
    with pytest.raises(ValueError, match="eval/accuracy needs eval/accuracy_ci_low"):
        monitor.update(2, {"eval/accuracy": 0.3})


def test_kl_band_without_baseline():
    monitor = Monitor(MonitorConfig(detectors=("kl_band",), window_steps=2))
    assert monitor.update(1, {"actor/kl": 0.0})["monitor/kl_band"] == 0.0
    assert monitor.update(2, {"actor/kl": 0.9})["monitor/kl_band"] == 0.0  # mean 0.45 <= 0.5
    assert monitor.update(3, {"actor/kl": 1.1})["monitor/kl_band"] == 1.0
    assert monitor.first_trip == Trip(3, ("kl_band",), 2)


def test_entropy_band_both_sides():
    for late, fires in [(0.49, 1.0), (0.55, 0.0), (1.45, 0.0), (1.6, 1.0)]:
        monitor = Monitor(MonitorConfig(detectors=("entropy_band",), baseline_steps=2, window_steps=1))
        for step, value in enumerate([1.0, 1.0, late], start=1):
            out = monitor.update(step, {"actor/entropy": value})
        assert out["monitor/entropy_band"] == fires, late


def test_entropy_drop_is_gated_by_rising_accuracy_but_a_rise_is_not():
    def run(acc_late: float, entropy_late: float) -> float:
        monitor = Monitor(MonitorConfig(detectors=("entropy_band",), baseline_steps=3, window_steps=2,
                                        accuracy_window_steps=2, samples_per_step=64))
        for step in range(1, 8):
            late = step > 3
            out = monitor.update(step, {"actor/entropy": entropy_late if late else 2.0,
                                        "reward/accuracy": acc_late if late else 0.1})
        return out["monitor/entropy_band"]

    assert run(acc_late=0.1, entropy_late=0.8) == 1.0   # collapse, accuracy flat: fires
    assert run(acc_late=0.6, entropy_late=0.8) == 0.0   # collapse while accuracy rises: a policy learning
    assert run(acc_late=0.6, entropy_late=3.5) == 1.0   # a rise fires whatever accuracy does


#: examples/learn_cpu.yaml's measured run (chain_sum, SmolLM2-135M, B = 4 × G = 8), steps 0–24 as logged: held-out
#: pass@1 7.8 % → 16.3 % → 30.5 %, length 53 → 23 tokens, entropy 2.05 → 0.88 nats per token.
LEARN_RUN = [
    (0, {"eval/accuracy": 0.078, "eval/accuracy_ci_low": 0.0486, "eval/accuracy_ci_high": 0.123, "eval/n": 205.0}),
    *[(i + 1, {"reward/reasoning_gym": acc, "response_length/mean": length, "actor/entropy": ent, "actor/kl": kl})
      for i, (acc, length, ent, kl) in enumerate([
          (0.0938, 52.6, 2.0458, 0.0), (0.2, 45.3, 2.1017, 0.0011), (0.112, 71.9, 2.336, 0.0031),
          (0.0312, 78.7, 2.0787, 0.0045), (0.1146, 88.7, 2.3223, 0.0066), (0.25, 67.3, 2.324, 0.0093),
          (0.125, 66.9, 2.1373, 0.0102), (0.0833, 85.2, 1.945, 0.0097), (0.0938, 84.3, 2.4285, 0.0118),
          (0.0, 70.8, 2.0085, 0.0165), (0.0625, 74.9, 1.7545, 0.0208), (0.1719, 68.3, 2.0301, 0.0249),
          (0.125, 62.5, 2.4857, 0.018), (0.0938, 70.9, 1.9158, 0.0291), (0.3472, 60.7, 1.6085, 0.0334),
          (0.313, 52.5, 2.083, 0.0506), (0.0, 51.6, 1.7662, 0.0436), (0.4062, 50.2, 1.7952, 0.0499),
          (0.2656, 52.8, 1.7051, 0.0624), (0.4688, 22.8, 1.2409, 0.1449), (0.2656, 35.2, 1.3068, 0.1047),
          (0.6094, 25.1, 1.053, 0.1251), (0.5625, 21.4, 0.9565, 0.1605), (0.1875, 23.3, 0.8775, 0.1965)])],
]
LEARN_RUN[10][1].update({"eval/accuracy": 0.1634, "eval/accuracy_ci_low": 0.1191, "eval/accuracy_ci_high": 0.2201,
                         "eval/n": 205.0})
LEARN_RUN[20][1].update({"eval/accuracy": 0.3049, "eval/accuracy_ci_low": 0.2459, "eval/accuracy_ci_high": 0.371,
                         "eval/n": 205.0})


def test_the_measured_learning_run_never_trips_though_its_entropy_halved():
    monitor = Monitor(MonitorConfig(verifiable_reward="reasoning_gym"))
    for step, row in LEARN_RUN:
        row = {**row, "rollout/groups_sampled": 4, "rollout/group_size": 8} if step else row
        assert monitor.update(step, row)["monitor/tripped"] == 0.0, step
    entropy = [row["actor/entropy"] for _, row in LEARN_RUN[1:]]
    # not vacuous: the last 3 steps' entropy is below half the first 5 steps' (the ungated rule fired at step 24)
    assert sum(entropy[-3:]) / 3 < 0.5 * sum(entropy[:5]) / 5


def test_missing_values_and_nan_do_not_move_windows():
    monitor = Monitor(MonitorConfig(detectors=("length_drift",), baseline_steps=2, window_steps=1))
    for step, row in enumerate([{"response_length/mean": 100.0}, {"eval/accuracy": 0.1, "eval/n": 10},
                                {"response_length/mean": float("nan")}, {"response_length/mean": 100.0}], start=1):
        assert monitor.update(step, row)["monitor/length_drift"] == 0.0
    assert monitor.update(5, {"response_length/mean": 131.0})["monitor/length_drift"] == 1.0


def test_steps_must_increase():
    monitor = Monitor()
    monitor.update(3, {})
    with pytest.raises(ValueError, match="got step 3 after step 3"):
        monitor.update(3, {})


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"detectors": ("length_drift", "nope")}, "detectors"), ({"detectors": ("kl_band", "kl_band")}, "detectors"),
    ({"baseline_steps": 0}, "baseline_steps"), ({"window_steps": 2.0}, "window_steps"),
    ({"noise_z": 0.0}, "noise_z"), ({"saturation_rise": -0.1}, "saturation_rise"), ({"kl_max": math.inf}, "kl_max"),
    ({"entropy_rise_frac": True}, "entropy_rise_frac"), ({"length_drift_frac": 1.0}, "length_drift_frac"),
    ({"entropy_drop_frac": 0.0}, "entropy_drop_frac"), ({"eval_confidence": 95}, "eval_confidence"),
    ({"verifiable_reward": "mean"}, "verifiable_reward"), ({"verifiable_reward": ""}, "verifiable_reward"),
    ({"shaping_rewards": ("format", "accuracy")}, "shaping_rewards"), ({"samples_per_step": 0}, "samples_per_step"),
    ({"kl_max": float("nan")}, "kl_max"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"monitor.{field} must be"):
        MonitorConfig(**kwargs)


def test_shaping_rewards_explicit_and_samples_per_step():
    # format is not watched when shaping_rewards names another component; counts come from samples_per_step.
    config = MonitorConfig(detectors=("reward_saturation",), shaping_rewards=("brevity",), samples_per_step=64)
    monitor = Monitor(config)
    for step in range(1, 10):
        late = step > 5
        out = monitor.update(step, {"reward/accuracy": 0.3, "reward/format": 0.9 if late else 0.1,
                                    "reward/brevity": 0.8 if step > 7 else 0.2})
    # step 8's window (0.2, 0.2, 0.8) rose 0.2 minus its noise: below the threshold; step 9's (0.2, 0.8, 0.8) fires
    assert out["monitor/reward_saturation"] == 1.0 and monitor.first_trip == Trip(9, ("reward_saturation",), 7)
