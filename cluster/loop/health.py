"""Health warnings: detectors that watch every step and warn without stopping the job (the spec's ``health`` section,
:class:`cluster.spec.health.HealthSpec`; the ``monitor`` section's guard is what stops).

Each detector is registered by name in :data:`HEALTH_DETECTORS` and judges one step from its metrics row and its
sampled completions (:class:`StepView`), keeping what it needs of earlier steps. Per step and enabled detector the
row gets ``health/<detector>`` (1 when it warned this step, else 0) and, when it measured something,
``health/value/<detector>`` and ``health/threshold/<detector>``; ``health/warnings`` counts the detectors that
warned. Each warning is also one console line naming the detector, its value and its threshold.

The detectors (thresholds: the spec's fields, null turns one off):

- ``repetition``: fraction of the step's completions that end in a repetition loop
  (:func:`cluster.loop.health_text.is_looping`) > ``repetition_max_fraction``.
- ``garbled``: fraction of the completions with garbled characters (:func:`cluster.loop.health_text.is_garbled`)
  > ``garbled_max_fraction``.
- ``stall``: ``timing/step_s`` / the median of the earlier steps' (the last :data:`STALL_HISTORY`, at least
  ``stall_min_steps`` of them) > ``stall_factor``.
- ``flat_run``: steps in a row whose sampled groups were all flat (``groups/all_equal_fraction`` = 1) >=
  ``flat_run_steps``.
- ``kl_jump``: ``actor/kl`` / its median over the previous ``jump_window_steps`` steps > ``kl_jump_factor``, and
  ``actor/kl`` − that median >= ``kl_jump_min_nats``.
- ``entropy_jump``: | ``actor/entropy`` − its median over the previous ``jump_window_steps`` steps | / that median >
  ``entropy_jump_frac``, and that move >= ``entropy_jump_min_nats``.
- ``infra_failures``: ``reward/infra_failed`` / the completions sampled > ``infra_failed_max_fraction``.
- ``engine_aborts``: completions with finish reason ``"abort"`` + engines replaced during the step (the rise of
  ``workers/restarts``) > ``engine_aborts_max``.

A variant is a class with ``name``, ``from_spec(spec) -> detector | None`` (None: off) and ``check(view) -> Reading |
None`` (None: nothing to judge this step), registered with :func:`register_health_detector`.
"""

from __future__ import annotations

import math
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cluster.loop.health_text import is_garbled, is_looping

__all__ = ["HEALTH_DETECTORS", "HealthMonitor", "Reading", "STALL_HISTORY", "StepView", "register_health_detector"]

#: Earlier steps the stall detector's median is taken over, at most.
STALL_HISTORY = 100


@dataclass(frozen=True)
class StepView:
    """What a detector sees of one step.

    Attributes:
        step: the step. metrics: its metrics row (``timing/step_s``, ``actor/kl``, ...).
        response_ids: every completion sampled this step (token ids; a multi-turn episode's whole response).
        texts: the same completions decoded. finish_reasons: their finish reasons.
    """

    step: int
    metrics: Mapping[str, object]
    response_ids: Sequence[Sequence[int]] = ()
    texts: Sequence[str] = ()
    finish_reasons: Sequence[str] = ()


@dataclass(frozen=True)
class Reading:
    """One detector's judgement of one step: ``value`` against ``threshold`` (in ``unit``), ``warned`` when it is
    beyond it, and ``what`` the value is (for the warning line)."""

    value: float
    threshold: float
    warned: bool
    what: str
    unit: str = ""

    def message(self, name: str, step: int) -> str:
        """The warning line, e.g. ``health: step 4: flat_run: steps in a row without a learning signal (every
        group's rewards equal): 4 (threshold 4); training goes on``."""
        unit = self.unit
        return (f"health: step {step}: {name}: {self.what} {_fmt(self.value)}{unit} (threshold {_fmt(self.threshold)}"
                f"{unit}); training goes on")


def _fmt(x: float) -> str:
    return f"{x:.3g}"


#: Detector name → its class (``from_spec``, ``check``).
HEALTH_DETECTORS: dict[str, type] = {}


def register_health_detector(cls: type) -> type:
    """Class decorator: register ``cls`` under ``cls.name``.

    Raises:
        ValueError: the name is taken, or is not lower-case letters and underscores.
    """
    name = getattr(cls, "name", "")
    if not name or not name.replace("_", "").isalpha() or not name.islower():
        raise ValueError(f"health detector {cls.__name__}: name {name!r}: expected lower-case letters and '_'")
    if name in HEALTH_DETECTORS:
        raise ValueError(f"health detector {name!r} is already registered ({HEALTH_DETECTORS[name].__name__})")
    HEALTH_DETECTORS[name] = cls
    return cls


def _number(metrics: Mapping[str, object], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@register_health_detector
class Repetition:
    name = "repetition"

    def __init__(self, max_fraction: float, min_repeats: int, min_tokens: int):
        self.max_fraction = max_fraction
        self.min_repeats = min_repeats
        self.min_tokens = min_tokens

    @classmethod
    def from_spec(cls, spec):
        if spec.repetition_max_fraction is None:
            return None
        return cls(spec.repetition_max_fraction, spec.repetition_min_repeats, spec.repetition_min_tokens)

    def check(self, view: StepView) -> Reading | None:
        if not view.response_ids:
            return None
        loops = sum(is_looping(ids, self.min_repeats, self.min_tokens) for ids in view.response_ids)
        share = loops / len(view.response_ids)
        return Reading(share, self.max_fraction, share > self.max_fraction,
                       f"{loops} of {len(view.response_ids)} completions end in a repetition loop, a fraction of")


@register_health_detector
class Garbled:
    name = "garbled"

    def __init__(self, max_fraction: float, min_chars: int):
        self.max_fraction = max_fraction
        self.min_chars = min_chars

    @classmethod
    def from_spec(cls, spec):
        return None if spec.garbled_max_fraction is None else cls(spec.garbled_max_fraction, spec.garbled_min_chars)

    def check(self, view: StepView) -> Reading | None:
        if not view.texts:
            return None
        bad = sum(is_garbled(text, self.min_chars) for text in view.texts)
        share = bad / len(view.texts)
        return Reading(share, self.max_fraction, share > self.max_fraction,
                       f"{bad} of {len(view.texts)} completions hold garbled characters (U+FFFD, control or "
                       f"unassigned code points), a fraction of")


@register_health_detector
class Stall:
    name = "stall"

    def __init__(self, factor: float, min_steps: int):
        self.factor = factor
        self.min_steps = min_steps
        self.history: deque[float] = deque(maxlen=STALL_HISTORY)

    @classmethod
    def from_spec(cls, spec):
        return None if spec.stall_factor is None else cls(spec.stall_factor, spec.stall_min_steps)

    def check(self, view: StepView) -> Reading | None:
        step_s = _number(view.metrics, "timing/step_s")
        if step_s is None:
            return None
        reading = None
        if len(self.history) >= self.min_steps:
            median = statistics.median(self.history)
            ratio = step_s / median if median > 0 else 0.0
            reading = Reading(ratio, self.factor, ratio > self.factor,
                              f"timing/step_s {step_s:.1f} s is this multiple of the median of the earlier steps "
                              f"({median:.1f} s):", "x")
        self.history.append(step_s)
        return reading


@register_health_detector
class FlatRun:
    name = "flat_run"

    def __init__(self, steps: int):
        self.steps = steps
        self.run = 0

    @classmethod
    def from_spec(cls, spec):
        return None if spec.flat_run_steps is None else cls(spec.flat_run_steps)

    def check(self, view: StepView) -> Reading | None:
        flat = _number(view.metrics, "groups/all_equal_fraction")
        if flat is None:
            return None
        self.run = self.run + 1 if flat >= 1.0 else 0
        return Reading(float(self.run), float(self.steps), self.run >= self.steps,
                       "steps in a row without a learning signal (every group's rewards equal):")


class _Jump(ABC):
    """A metric against its median over the previous ``window`` steps (judged once there are that many)."""

    key = ""

    def __init__(self, window: int):
        self.history: deque[float] = deque(maxlen=window)

    @abstractmethod
    def _judge(self, value: float, median: float) -> Reading:
        """The reading of ``value`` against ``median`` (each jump detector its own rule)."""

    def check(self, view: StepView) -> Reading | None:
        value = _number(view.metrics, self.key)
        if value is None:
            return None
        full = len(self.history) == self.history.maxlen
        reading = self._judge(value, statistics.median(self.history)) if full else None
        self.history.append(value)
        return reading


@register_health_detector
class KLJump(_Jump):
    name, key = "kl_jump", "actor/kl"

    def __init__(self, factor: float, min_nats: float, window: int):
        super().__init__(window)
        self.factor = factor
        self.min_nats = min_nats

    @classmethod
    def from_spec(cls, spec):
        if spec.kl_jump_factor is None:
            return None
        return cls(spec.kl_jump_factor, spec.kl_jump_min_nats, spec.jump_window_steps)

    def _judge(self, value: float, median: float) -> Reading:
        ratio = value / median if median > 0 else (math.inf if value > 0 else 0.0)
        jumped = ratio > self.factor and value - median >= self.min_nats
        return Reading(min(ratio, 1e9), self.factor, jumped,
                       f"actor/kl {value:.4g} nats is this multiple of its recent median ({median:.4g}, "
                       f"at least {self.min_nats:g} nats above it to count):", "x")


@register_health_detector
class EntropyJump(_Jump):
    name, key = "entropy_jump", "actor/entropy"

    def __init__(self, frac: float, min_nats: float, window: int):
        super().__init__(window)
        self.frac = frac
        self.min_nats = min_nats

    @classmethod
    def from_spec(cls, spec):
        if spec.entropy_jump_frac is None:
            return None
        return cls(spec.entropy_jump_frac, spec.entropy_jump_min_nats, spec.jump_window_steps)

    def _judge(self, value: float, median: float) -> Reading:
        change = abs(value - median) / median if median > 0 else 0.0
        return Reading(change, self.frac, change > self.frac and abs(value - median) >= self.min_nats,
                       f"actor/entropy {value:.3g} nats moved from its recent median ({median:.3g}, at least "
                       f"{self.min_nats:g} nats to count) by a fraction of")


@register_health_detector
class InfraFailures:
    name = "infra_failures"

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction

    @classmethod
    def from_spec(cls, spec):
        return None if spec.infra_failed_max_fraction is None else cls(spec.infra_failed_max_fraction)

    def check(self, view: StepView) -> Reading | None:
        failed = _number(view.metrics, "reward/infra_failed")
        sampled = len(view.texts) or _sampled(view.metrics)
        if failed is None or not sampled:
            return None
        share = failed / sampled
        return Reading(share, self.max_fraction, share > self.max_fraction,
                       f"{failed:.0f} of {sampled} completions got no reward (an infrastructure failure), a fraction "
                       f"of")


def _sampled(metrics: Mapping[str, object]) -> int:
    """Completions sampled by the step, from its row (groups sampled × G) when the completions are not given."""
    groups, size = _number(metrics, "rollout/groups_sampled"), _number(metrics, "rollout/group_size")
    return int(groups * size) if groups is not None and size is not None else 0


@register_health_detector
class EngineAborts:
    name = "engine_aborts"

    def __init__(self, max_aborts: int):
        self.max_aborts = max_aborts
        self.restarts: float | None = None  # workers/restarts at the previous step

    @classmethod
    def from_spec(cls, spec):
        return None if spec.engine_aborts_max is None else cls(spec.engine_aborts_max)

    def check(self, view: StepView) -> Reading | None:
        restarts = _number(view.metrics, "workers/restarts")
        replaced = 0.0 if restarts is None or self.restarts is None else max(0.0, restarts - self.restarts)
        if restarts is not None:
            self.restarts = restarts
        aborted = sum(reason == "abort" for reason in view.finish_reasons)
        count = aborted + replaced
        return Reading(count, float(self.max_aborts), count > self.max_aborts,
                       f"{aborted} completion(s) aborted by an engine and {replaced:.0f} engine(s) replaced:")


class HealthMonitor:
    """The enabled detectors of a ``health`` section, fed one step at a time.

    Args:
        spec: the ``health`` section (:class:`cluster.spec.health.HealthSpec`).
        warn: called with each warning line (the job's status line on the console).

    Attributes:
        detectors: name → the enabled detector. warned: name → steps it warned on, in this job.
        overhead_s: seconds the detectors took so far.
    """

    def __init__(self, spec, warn: Callable[[str], None]):
        self.spec = spec
        self.warn = warn
        self.overhead_s = 0.0
        self.restart()

    def restart(self, rows: Sequence[Mapping[str, object]] = ()) -> None:
        """Start the detectors afresh (a resumed or rolled-back job), then feed them earlier steps' rows
        (``metrics.jsonl`` up to the checkpoint's step, in step order) without warning, so their history (step times,
        flat run, KL and entropy medians, restarts) is what the uninterrupted run's was. Rows without
        ``policy_version`` (the step-0 evaluation) are skipped."""
        spec = self.spec
        self.detectors = {} if not spec.enabled else {
            name: d for name, cls in HEALTH_DETECTORS.items() if (d := cls.from_spec(spec)) is not None}
        self.warned: dict[str, list[int]] = {name: [] for name in self.detectors}
        for row in rows:
            if "policy_version" in row:
                for detector in self.detectors.values():
                    detector.check(StepView(int(row["step"]), row))

    def observe(self, view: StepView) -> dict[str, float]:
        """Judge one step; warns for each detector beyond its threshold. Returns the ``health/*`` metrics ({} when
        every detector is off)."""
        if not self.detectors:
            return {}
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        lines = []
        for name, detector in self.detectors.items():
            reading = detector.check(view)
            out[f"health/{name}"] = float(reading is not None and reading.warned)
            if reading is None:
                continue
            out[f"health/value/{name}"] = float(reading.value)
            out[f"health/threshold/{name}"] = float(reading.threshold)
            if reading.warned:
                self.warned[name].append(view.step)
                lines.append(reading.message(name, view.step))
        out["health/warnings"] = float(len(lines))
        self.overhead_s += time.perf_counter() - t0
        for line in lines:
            self.warn(line)
        return out
