"""The rollout side's figures of one step, which the fleet collects and the loop reports (``rollout/*``, per-engine
series). No project imports: every role may read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.messages import EngineLoad, PoolGenerateStats

__all__ = ["FleetFigures"]


@dataclass
class FleetFigures:
    """The fleet's figures of one step, over its sampling rounds (accepted generate calls only).

    Attributes:
        tokens: response tokens sampled. idle_fractions: each call's engine idle fraction, in [0, 1].
        per_engine: engine index → the step's :class:`EngineLoad`: ``groups`` dispatched, response ``tokens``, busy
            ``seconds`` and the estimated peak ``kv_cache_usage`` (fraction) over the step's calls.
        stale_refused: groups refused for being older than ``rollout.max_staleness``.
    """

    tokens: int = 0
    idle_fractions: list[float] = field(default_factory=list)
    per_engine: dict[int, EngineLoad] = field(default_factory=dict)
    stale_refused: int = 0

    def add(self, stats: PoolGenerateStats) -> None:
        """Add one generate call's stats (:meth:`RolloutPool.generate`'s)."""
        self.idle_fractions.append(stats.engine_idle_fraction)
        for k, e in enumerate(stats.per_engine):
            acc = self.per_engine.get(k, EngineLoad(groups=0))
            self.per_engine[k] = EngineLoad(groups=acc.groups + e.groups, tokens=acc.tokens + e.tokens,
                                            seconds=acc.seconds + e.seconds,
                                            kv_cache_usage=max(acc.kv_cache_usage or 0.0, e.kv_cache_usage or 0.0))
        self.tokens += stats.tokens

    @property
    def idle_fraction(self) -> float:
        """Mean engine idle fraction over the step's generate calls (0.0 when none)."""
        return sum(self.idle_fractions) / len(self.idle_fractions) if self.idle_fractions else 0.0
