"""The rollout side's figures of one step, which the fleet collects and the loop reports (``rollout/*``, per-engine
series). No project imports: every role may read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.messages import EngineLoad, PoolGenerateStats
from contract.requests import TokenResult

__all__ = ["FleetFigures"]


@dataclass
class FleetFigures:
    """The fleet's figures of one step, over its sampling rounds (accepted generate calls only).

    Request-level generation (``contract.requests``) adds its own figures: each served request's queue seconds
    (``rollout/request_queue_s``), its tokens, and the engines' busy seconds read from their own counters
    (``TokenResult.busy_s``) over the step's request window, from its first submission to its last result; the
    window's engine-seconds join the step's ``idle_fraction`` (``rollout/engine_idle_fraction``).

    Attributes:
        tokens: response tokens sampled. idle_fractions: each call's engine idle fraction, in [0, 1].
        busy_seconds, capacity_seconds: the calls' busy engine-seconds and engine capacity (engines × wall seconds)
            summed; capacity None once a call did not measure it.
        per_engine: engine index → the step's :class:`EngineLoad`: ``groups`` dispatched (requests, for
            request-level generation), response ``tokens``, busy ``seconds`` and the estimated peak ``kv_cache_usage``
            (fraction) over the step's calls.
        stale_refused: groups refused for being older than ``rollout.max_staleness``.
        engines: engines serving when the step began (the request window's idle share counts every one).
        busy_base: engine index → its busy counter when the step began (the newest one its fleet had seen).
        request_queue_s: each served request's seconds from submission to its engine starting it.
        busy_seen: engine index → its newest busy counter seen this step.
        window: (first submission, last result) of the step's requests, ``time.perf_counter()`` seconds; None before.
    """

    tokens: int = 0
    idle_fractions: list[float] = field(default_factory=list)
    per_engine: dict[int, EngineLoad] = field(default_factory=dict)
    stale_refused: int = 0
    busy_seconds: float = 0.0
    capacity_seconds: float | None = 0.0
    engines: int = 0
    busy_base: dict[int, float] = field(default_factory=dict)
    request_queue_s: list[float] = field(default_factory=list)
    busy_seen: dict[int, float] = field(default_factory=dict)
    window: tuple[float, float] | None = None

    def add_request(self, engine: int, result: TokenResult, submitted: float, done: float) -> None:
        """Add one served request (``submitted``/``done``: ``time.perf_counter()`` at submission and at its result,
        the fleet's clock). Results arrive on the engines' threads: the fleet serialises the calls."""
        self.request_queue_s.append(result.queue_s)
        self.tokens += len(result.token_ids)
        before = self._request_busy(engine)
        self.busy_seen[engine] = max(self.busy_seen.get(engine, 0.0), result.busy_s)
        load = self.per_engine.get(engine, EngineLoad(groups=0))
        self.per_engine[engine] = EngineLoad(groups=load.groups + 1, tokens=load.tokens + len(result.token_ids),
                                             seconds=load.seconds + self._request_busy(engine) - before,
                                             kv_cache_usage=load.kv_cache_usage)
        first, last = self.window if self.window is not None else (submitted, done)
        self.window = (min(first, submitted), max(last, done))

    def _request_busy(self, engine: int) -> float:
        """Seconds ``engine`` served requests this step: its newest counter minus its base (from 0 when the counter
        is below the base: a replaced engine starts at 0)."""
        seen = self.busy_seen.get(engine)
        if seen is None:
            return 0.0
        base = self.busy_base.get(engine, 0.0)
        return seen - (base if seen >= base else 0.0)

    @property
    def request_idle_fraction(self) -> float | None:
        """1 − Σ seconds the engines served requests during the step's request window / (engines × the window's
        seconds), in [0, 1]. None without requests."""
        if self.window is None:
            return None
        wall = self.window[1] - self.window[0]
        engines = max(self.engines, len(self.busy_seen), 1)
        busy = sum(self._request_busy(e) for e in self.busy_seen)
        return min(1.0, max(0.0, 1.0 - busy / (engines * wall))) if wall > 0 else 0.0

    @property
    def request_queue_mean_s(self) -> float | None:
        """Mean seconds a request of the step waited before its engine started it (None without requests)."""
        queued = list(self.request_queue_s)
        return sum(queued) / len(queued) if queued else None

    def add(self, stats: PoolGenerateStats) -> None:
        """Add one generate call's stats (:meth:`RolloutPool.generate`'s)."""
        self.idle_fractions.append(stats.engine_idle_fraction)
        self.busy_seconds += sum(stats.engine_seconds)
        measured = getattr(stats, "capacity_seconds", None)
        self.capacity_seconds = None if measured is None or self.capacity_seconds is None else \
            self.capacity_seconds + measured
        for k, e in enumerate(stats.per_engine):
            acc = self.per_engine.get(k, EngineLoad(groups=0))
            self.per_engine[k] = EngineLoad(groups=acc.groups + e.groups, tokens=acc.tokens + e.tokens,
                                            seconds=acc.seconds + e.seconds,
                                            kv_cache_usage=max(acc.kv_cache_usage or 0.0, e.kv_cache_usage or 0.0))
        self.tokens += stats.tokens

    @property
    def idle_fraction(self) -> float:
        """Fraction of the engines' time idle over the step's generate calls and its request window together:
        1 − Σ busy engine-seconds / Σ engines × wall seconds, in [0, 1] (a long call weighs more than a short one);
        the mean of the fractions when a call did not measure its capacity; 0.0 when there was neither."""
        busy, capacity = self.busy_seconds, self.capacity_seconds
        if self.window is not None and capacity is not None:
            wall = self.window[1] - self.window[0]
            busy += sum(self._request_busy(e) for e in self.busy_seen)
            capacity += max(self.engines, len(self.busy_seen), 1) * max(wall, 0.0)
        if not self.idle_fractions and self.window is None:
            return 0.0
        if capacity:
            return min(1.0, max(0.0, 1.0 - busy / capacity))
        fractions = list(self.idle_fractions)
        if self.window is not None:
            fractions.append(self.request_idle_fraction)
        return sum(fractions) / len(fractions)
