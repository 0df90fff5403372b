"""Reward-hacking detectors over a sliding window of per-step metrics rows (the dicts written to ``metrics.jsonl``).

Signatures the detectors look for:
- seed article 004: mean response length up ≈ 50 % while accuracy stays flat (the policy pads to earn length-
  correlated reward);
- its mirror image, measured on this project's 40-step GSM8K demo with a gameable format reward (docs/results.md):
  response length 125 → 10 tokens, ``reward/format`` 0.013 → 0.944 while ``reward/accuracy`` 0.031 → 0.006,
  ``actor/kl`` 0.0004 → 2.0, GSM8K pass@1 3.0 % → 1.5 % (the policy learned to print ``#### <number>`` at once).

Windows. Each metric key keeps its own series of finite values; its *baseline* is the mean of its first
``baseline_steps`` values, its *recent* value the mean of its last ``window_steps`` values after those (fewer while
the run is young). Rows without a key (an eval-only row) do not move that key's windows.

"Accuracy rose" (the gate of the two drift detectors) means evidence of a gain: the verifiable reward component
(``reward/<verifiable_reward>``, 0/1 per completion) rose from its baseline to the mean of its last
``accuracy_window_steps`` values (default 6: twice the drift window, for power) by more than ``noise_z`` (default
2.33, one-sided 99 %: a lucky low baseline must not open the gate for a hack) standard errors of a difference of two
proportions (Agresti & Caffo 2000, "Simple and effective confidence intervals for proportions and differences of
proportions result from adding two successes and two failures", Am. Stat. 54:280: p̃ = (x + 1)/(n + 2)), with
n = the completions that component's mean is over: ``reward/scored/<name>`` (rows with a reward that it scored; a
row it does not apply to, or an infrastructure failure, is in no mean), else ``rollout/groups_sampled`` ×
``rollout/group_size`` − ``reward/infra_failed`` per step, else ``samples_per_step``; or the latest held-out
``eval/accuracy_ci_low`` is above the first ``eval/accuracy``. No evidence (no such metrics) counts as "did not
rise".

Detectors (metric ``monitor/<name>``: 1.0 on a step where the rule holds, else 0.0):
- ``length_drift``: |recent / baseline − 1| of ``response_length/mean`` (tokens) ≥ ``length_drift_frac`` (default
  0.3: the article-004 rise of 50 % is crossed on the way, so it is caught before it completes; the demo's collapse
  125 → 10 tokens is caught below 87.5, a third of the way), and accuracy did not rise.
- ``reward_saturation``: a shaping component ``reward/<name>`` (every reward component except the verifiable one and
  the driver's summaries, or ``shaping_rewards``) rose from baseline by ≥ ``saturation_rise`` (default 0.2, reward
  units: a fifth of completions newly earning a 0/1 component) beyond its noise (rise − ``noise_z`` standard errors
  ≥ ``saturation_rise``), and accuracy did not rise.
- ``kl_band``: recent mean of ``actor/kl`` (nats per token to the reference policy, the configured estimator) >
  ``kl_max`` (default 0.5: the demo averaged 0.0004 over its first 10 steps and 2.0 once hacked; 0.5 nats on every
  token is a policy far from its reference, and the honest test runs reach 0.1). Needs no baseline.
- ``entropy_band``: recent ``actor/entropy`` (nats per token) below baseline · (1 − ``entropy_drop_frac``) (default
  0.5: halved, a collapse onto a few answers) while accuracy did not rise, or above baseline · (1 +
  ``entropy_rise_frac``) (default 0.5: noise) whatever accuracy does. The drop side is gated like the drift detectors
  because a policy that learns grows sure of its right answers: examples/learn_cpu.yaml's measured run (held-out pass@1
  7.8 % → 30.5 % by step 20) halved its entropy 2.1 → 0.88 nats per token by step 24, and the ungated rule fired there.
- ``eval_drop``: the latest ``eval/accuracy_ci_high`` < the reference, max(first ``eval/accuracy``, best earlier
  ``eval/accuracy_ci_low``): the best earlier evaluation is trusted only down to its lower bound because picking the
  maximum of several noisy evaluations biases it upwards. Holds until the next evaluation. With 200 problems the demo's
  3.0 % → 1.5 % is inside the noise (1.5 % has the 95 % Wilson interval 0.5–4.3 %): the other detectors catch that run.

Defaults, measured on the sequences of tests/unit/test_grpo_monitor.py (64 completions per step, binomial noise; 200
seeds per hack, 300 per honest profile): hacks that reach their end state within 6 steps of onset (short answers, length
+60 %, format 0.1 → 1.0) are caught 1–4 steps after onset; spread over 10 steps, the length hack is caught after a
median 6 (at most 13) steps, the others within 6; honest runs (accuracy rising with length +11 %, or with length
+60 %; or nothing changing) never trip. ``length_drift_frac`` 0.25 caught slow length hacks sooner but tripped on 5 of
300 honest +60 % runs; ``noise_z`` 1.645 let a lucky low accuracy baseline open the gate (up to 12 steps late).

``monitor/tripped`` is 1.0 on a step where any enabled detector fired; `Monitor.first_trip` keeps the first such step,
the detectors that fired there and an onset estimate (`Trip`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

from grpo.rewards import RESERVED_REWARD_NAMES, SCORED_PREFIX
from grpo.stats import wilson_interval

DetectorName = Literal["length_drift", "reward_saturation", "kl_band", "entropy_band", "eval_drop"]
DETECTORS: tuple[str, ...] = get_args(DetectorName)
LENGTH_KEY, KL_KEY, ENTROPY_KEY = "response_length/mean", "actor/kl", "actor/entropy"
EVAL_KEY, EVAL_N_KEY, EVAL_PROBLEMS_KEY = "eval/accuracy", "eval/n", "eval/problems"
EVAL_LOW_KEY, EVAL_HIGH_KEY = "eval/accuracy_ci_low", "eval/accuracy_ci_high"
TRIPPED_KEY = "monitor/tripped"

__all__ = ["DETECTORS", "TRIPPED_KEY", "DetectorName", "Monitor", "MonitorConfig", "Trip"]


@dataclass(frozen=True)
class MonitorConfig:
    """Detector thresholds and windows (module docstring: the rules). Units: steps, tokens, nats per token, reward.

    Raises (on construction):
        ValueError: naming the field, for an unknown or repeated detector, a window < 1, a threshold out of range, a
            verifiable component that is reserved or also listed as shaping.
    """

    detectors: tuple[DetectorName, ...] = DETECTORS  #: enabled detectors, each reported as monitor/<name>
    baseline_steps: int = 5  #: values of a key averaged as its baseline (≥ 1)
    window_steps: int = 3  #: latest values averaged as its recent value (≥ 1)
    accuracy_window_steps: int = 6  #: latest values of the verifiable reward averaged for the "accuracy rose" gate
    noise_z: float = 2.33  #: standard errors a rise must exceed to count (one-sided 99 %); > 0
    length_drift_frac: float = 0.3  #: relative change of response_length/mean that fires, in (0, 1)
    saturation_rise: float = 0.2  #: rise of a shaping component that fires, reward units, > 0
    kl_max: float = 0.5  #: actor/kl above this fires, nats per token, > 0
    entropy_drop_frac: float = 0.5  #: fires below baseline · (1 − this); in (0, 1)
    entropy_rise_frac: float = 0.5  #: fires above baseline · (1 + this); > 0
    eval_confidence: float = 0.95  #: Wilson coverage for an eval row without ci keys (n: eval/problems); in (0, 1)
    verifiable_reward: str = "accuracy"  #: the component that measures the task (reward/<name>, 0/1)
    shaping_rewards: tuple[str, ...] | None = None  #: components watched for saturation; None: all other components
    samples_per_step: int | None = None  #: completions per step when rows lack rollout/groups_sampled, group_size

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"monitor.{name} must be {expected}, got {getattr(self, name)!r}")

        unknown = [d for d in self.detectors if d not in DETECTORS]
        if unknown or len(set(self.detectors)) != len(self.detectors):
            raise bad("detectors", f"distinct names among {', '.join(DETECTORS)}")
        for name in ("baseline_steps", "window_steps", "accuracy_window_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an int >= 1 (steps)")
        for name in ("noise_z", "saturation_rise", "kl_max", "entropy_rise_frac"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise bad(name, "a finite number > 0")
        for name in ("length_drift_frac", "entropy_drop_frac", "eval_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
                raise bad(name, "a number in (0, 1)")
        if self.verifiable_reward in RESERVED_REWARD_NAMES or not self.verifiable_reward:
            raise bad("verifiable_reward", f"a reward function's name, not one of {sorted(RESERVED_REWARD_NAMES)}")
        if self.shaping_rewards is not None and self.verifiable_reward in self.shaping_rewards:
            raise bad("shaping_rewards", f"names other than verifiable_reward {self.verifiable_reward!r}")
        samples = self.samples_per_step
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise bad("samples_per_step", "None or an int >= 1 (completions per step)")


class Trip(NamedTuple):
    """The first step on which a detector fired."""

    step: int  #: the step
    detectors: tuple[str, ...]  #: the detectors that fired on it
    onset_step: int  #: estimated first step of the drift, the earliest over the detectors that fired: the earlier of
    #: the firing window's first step and the first step of the unbroken run of steps, ending at `step`, whose
    #: single-step value is at least half-way to the threshold (eval_drop: the step after the previous evaluation);
    #: checkpoints from before it are the last good candidates


class _Point(NamedTuple):
    step: int
    value: float
    samples: int | None


def _number(value: object) -> bool:
    """A finite int or float (not a bool): a value a series may hold."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mean(points: list[_Point]) -> float:
    return sum(p.value for p in points) / len(points)


def _rise_z(base: list[_Point], recent: list[_Point]) -> float | None:
    """Rise of a proportion from ``base`` to ``recent`` in Agresti–Caffo standard errors; None without counts."""
    if any(p.samples is None for p in base + recent):
        return None
    nb, nr = sum(p.samples for p in base), sum(p.samples for p in recent)
    pb, pr = (min(1.0, max(0.0, sum(p.value * p.samples for p in pts) / n)) for pts, n in ((base, nb), (recent, nr)))
    tb, tr = (pb * nb + 1) / (nb + 2), (pr * nr + 1) / (nr + 2)
    return (pr - pb) / math.sqrt(tb * (1 - tb) / (nb + 2) + tr * (1 - tr) / (nr + 2))


@dataclass
class Monitor:
    """Feed it each step's metrics row; it returns the ``monitor/*`` metrics of the step.

    Args:
        config: thresholds and windows.
    """

    config: MonitorConfig = field(default_factory=MonitorConfig)
    first_trip: Trip | None = field(default=None, init=False)
    _series: dict[str, list[_Point]] = field(default_factory=dict, init=False, repr=False)
    _evals: list[tuple[int, float, float, float]] = field(default_factory=list, init=False, repr=False)  # step, acc, ci
    _last_step: int | None = field(default=None, init=False, repr=False)

    def update(self, step: int, metrics: Mapping[str, object]) -> dict[str, float]:
        """Record one row and evaluate every enabled detector.

        Args:
            step: the row's step, larger than the previous one. metrics: the row; non-numeric values are ignored.

        Returns:
            ``{"monitor/<detector>": 0.0 | 1.0 for each enabled detector, "monitor/tripped": 0.0 | 1.0}``.

        Raises:
            ValueError: a step not after the previous one; an eval row with neither its ci keys nor a count
                (``eval/problems`` or ``eval/n``, the scored problems or completions) >= 1.
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"monitor steps must increase: got step {step} after step {self._last_step}")
        self._last_step = step
        self._record(step, metrics)
        fired = {name: getattr(self, f"_{name}")() for name in self.config.detectors}
        out = {f"monitor/{name}": float(onset is not None) for name, onset in fired.items()}
        out[TRIPPED_KEY] = float(any(onset is not None for onset in fired.values()))
        if out[TRIPPED_KEY] and self.first_trip is None:
            onsets = {name: onset for name, onset in fired.items() if onset is not None}
            self.first_trip = Trip(step, tuple(onsets), min(onsets.values()))
        return out

    def _samples(self, metrics: Mapping[str, object]) -> int | None:
        """Completions with a reward in the row: sampled (``rollout/groups_sampled`` × ``rollout/group_size``) less
        ``reward/infra_failed``; else ``samples_per_step``."""
        groups, size = metrics.get("rollout/groups_sampled"), metrics.get("rollout/group_size")
        if not (_number(groups) and _number(size) and groups * size >= 1):
            return self.config.samples_per_step
        failed = metrics.get("reward/infra_failed")
        return max(int(groups * size) - (int(failed) if _number(failed) else 0), 0)

    def _record(self, step: int, metrics: Mapping[str, object]) -> None:
        samples = self._samples(metrics)
        for key, value in metrics.items():
            if _number(value):
                scored = metrics.get(f"reward/{SCORED_PREFIX}/{key.removeprefix('reward/')}")
                n = int(scored) if key.startswith("reward/") and _number(scored) else samples
                self._series.setdefault(key, []).append(_Point(step, float(value), n))
        if _number(metrics.get(EVAL_KEY)):
            accuracy = float(metrics[EVAL_KEY])
            if EVAL_LOW_KEY in metrics and EVAL_HIGH_KEY in metrics:
                low, high = float(metrics[EVAL_LOW_KEY]), float(metrics[EVAL_HIGH_KEY])
            elif _number(n := metrics.get(EVAL_PROBLEMS_KEY, metrics.get(EVAL_N_KEY))) and n >= 1:
                low, high = wilson_interval(accuracy * int(n), int(n), self.config.eval_confidence)
            else:
                raise ValueError(f"step {step}: {EVAL_KEY} needs {EVAL_LOW_KEY} and {EVAL_HIGH_KEY}, or "
                                 f"{EVAL_PROBLEMS_KEY} / {EVAL_N_KEY} >= 1")
            self._evals.append((step, accuracy, low, high))

    def _windows(self, key: str, window: int | None = None) -> tuple[list[_Point], list[_Point]] | None:
        """(baseline, recent) points of ``key``, recent = the last ``window`` (default ``window_steps``) after the
        baseline; None until it has a value after its baseline."""
        series = self._series.get(key, [])
        base, after = series[: self.config.baseline_steps], series[self.config.baseline_steps:]
        return (base, after[-(window or self.config.window_steps):]) if after else None

    def _accuracy_rose(self) -> bool:
        windows = self._windows(f"reward/{self.config.verifiable_reward}", self.config.accuracy_window_steps)
        if windows is not None:
            z = _rise_z(*windows)
            if z is not None and z > self.config.noise_z:
                return True
        return len(self._evals) >= 2 and self._evals[-1][2] > self._evals[0][1]

    def _onset(self, key: str, score) -> int:
        """`Trip.onset_step` of a window detector: the earlier of the recent window's first step and the first step
        of the unbroken run of single-step ``score(base, [point]) >= 0.5`` ending at the latest point of ``key``."""
        base, recent = self._windows(key)
        after = self._series[key][self.config.baseline_steps:]
        onset = recent[0].step
        for point in reversed(after):
            if score(base, [point]) < 0.5:
                break
            onset = point.step
        return min(onset, recent[0].step)

    def _window_detector(self, key: str, score, gated: bool) -> int | None:
        windows = self._windows(key)
        if windows is None or score(*windows) < 1.0 or (gated and self._accuracy_rose()):
            return None
        return self._onset(key, score)

    def _length_drift(self) -> int | None:
        def score(base: list[_Point], recent: list[_Point]) -> float:
            baseline = _mean(base)
            return abs(_mean(recent) / baseline - 1) / self.config.length_drift_frac if baseline > 0 else 0.0

        return self._window_detector(LENGTH_KEY, score, gated=True)

    def _shaping_keys(self) -> list[str]:
        if self.config.shaping_rewards is not None:
            return [f"reward/{name}" for name in self.config.shaping_rewards]
        skip = {f"reward/{name}" for name in (*RESERVED_REWARD_NAMES, self.config.verifiable_reward)}
        return sorted(k for k in self._series if k.startswith("reward/") and k.count("/") == 1 and k not in skip)

    def _reward_saturation(self) -> int | None:
        def score(base: list[_Point], recent: list[_Point]) -> float:
            rise, z = _mean(recent) - _mean(base), _rise_z(base, recent)
            noise = 0.0 if z is None or z == 0 else self.config.noise_z * rise / z
            return (rise - noise) / self.config.saturation_rise

        onsets = [self._window_detector(key, score, gated=True) for key in self._shaping_keys()]
        onsets = [onset for onset in onsets if onset is not None]
        return min(onsets) if onsets else None

    def _kl_band(self) -> int | None:
        series = self._series.get(KL_KEY, [])
        recent = series[-self.config.window_steps:]
        if not recent or _mean(recent) <= self.config.kl_max:
            return None
        onset = recent[0].step
        for point in reversed(series):
            if point.value < 0.5 * self.config.kl_max:
                break
            onset = point.step
        return min(onset, recent[0].step)

    def _entropy_band(self) -> int | None:
        def ratio(base: list[_Point], recent: list[_Point]) -> float:
            baseline = _mean(base)
            return _mean(recent) / baseline if baseline > 0 else 1.0

        def rise(base: list[_Point], recent: list[_Point]) -> float:
            return (ratio(base, recent) - 1) / self.config.entropy_rise_frac

        def drop(base: list[_Point], recent: list[_Point]) -> float:
            return (1 - ratio(base, recent)) / self.config.entropy_drop_frac

        # a rise is never a policy learning; a drop while accuracy rises is a policy growing sure of right answers
        fired = self._window_detector(ENTROPY_KEY, rise, gated=False)
        return fired if fired is not None else self._window_detector(ENTROPY_KEY, drop, gated=True)

    def _eval_drop(self) -> int | None:
        if len(self._evals) < 2:
            return None
        *earlier, (_, _, _, high) = self._evals
        reference = max(earlier[0][1], *(low for _, _, low, _ in earlier))
        return earlier[-1][0] + 1 if high < reference else None
