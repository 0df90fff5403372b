"""``rollout.mode`` as strategies of one schedule: what each mode generates when, and what it adds to a step's
metrics and to a checkpoint. The job holds one strategy and never asks which mode it runs.

Every strategy drives a :mod:`cluster.loop.overlap` schedule over the same three phases — produce a step's batch
(:class:`cluster.loop.production.BatchProducer`), train on it and sync the new weights
(:class:`cluster.loop.training.TrainPhase`):

* :class:`SyncRollout` (``sync``): generate → train → sync one after the other; samples are on-policy.
* :class:`OneStepOffRollout` (``one_step_off``): the next step's batch is generated while this one trains (staleness
  1); the trained batch's audit (``sample_versions``), ``rollout/inflight_resampled`` and
  ``rollout/prefetch_deferred`` are reported, and a checkpoint records the data position of the trained batches
  only (``inflight``).
* :class:`AsyncRollout` (``async``): batches back to back up to ``rollout.max_staleness`` ahead, stale heads dropped
  and counted (``rollout/staleness_hist/*``, ``rollout/stale_dropped*``, ``rollout/queued_batches``; the run's count
  is kept by checkpoints), optionally with partial rollouts (the producer's call interrupted after each train step).

``ROLLOUT_MODES`` maps the spec's names to the strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cluster.loop.checkpoint_state import inflight_groups, stale_dropped_total
from cluster.loop.overlap import AsyncSchedule, StepOutcome, SyncSchedule
from cluster.loop.production import BatchProducer, batch_version
from cluster.loop.step_metrics import StepBatch, async_metrics
from cluster.loop.training import TrainPhase
from contract.errors import RecoveryDeferred

__all__ = ["AsyncRollout", "OneStepOffRollout", "ROLLOUT_MODES", "SyncRollout", "make_rollout"]


class SyncRollout:
    """``rollout.mode: sync``: generate(k) → train → sync.

    Args:
        spec: the job spec. producer: makes each step's batch. training: the train and sync phases.
        version: → the trainer's current policy version. status: one-line progress messages.
    """

    name = "sync"

    def __init__(self, spec, producer: BatchProducer, training: TrainPhase, version: Callable[[], int],
                 status: Callable[[str], None]):
        self.spec, self.producer, self.training, self.version, self._status = spec, producer, training, version, status
        self.schedule = self._make_schedule()
        self._step = 0  # the step running now
        self._bar = None

    def _make_schedule(self):
        return SyncSchedule(self._generate, self.training.train, self.training.sync)

    def _generate(self, step: int) -> StepBatch:
        overlapped = step > self._step
        return self.producer.produce(step, self.version() + step - self._step, overlapped,
                                     bar=None if overlapped else self._bar)

    @property
    def queued(self) -> list[StepBatch]:
        """Batches generated ahead of their steps, oldest first (none in ``sync``)."""
        return self.schedule.queued

    def step(self, step: int, bar=None) -> StepOutcome:
        """Run step ``step`` (generate, train, sync in this mode's order); ``bar`` shows the phases."""
        self._step, self._bar = step, bar
        return self.schedule.step(step, prefetch_next=step < self.spec.total_steps)

    def metrics(self, outcome: StepOutcome) -> dict:
        """The mode's own metrics of a finished step: none in ``sync``."""
        return {}

    def sample_versions(self, batch: StepBatch) -> list[int] | None:
        """The staleness audit of ``trained_prompts.jsonl`` (each trained group's sampling version); None in
        ``sync`` (every group is sampled by the version before the step)."""
        return None

    def inflight(self) -> dict | None:
        """What a checkpoint records as in flight (``driver_state``'s ``inflight``): None in ``sync``."""
        return None

    def state_dict(self) -> dict:
        """The mode's own checkpoint fields: none in ``sync``."""
        return {}

    def restore(self, path: Path) -> None:
        """Forget everything generated ahead (a rollback or resume to checkpoint ``path``)."""
        self.schedule.discard()
        self.producer.discard_carried()


class OneStepOffRollout(SyncRollout):
    """``rollout.mode: one_step_off``: step k+1's batch is generated on the weights step k starts from while step k
    trains (an :class:`AsyncSchedule` with ``max_staleness`` 1)."""

    name = "one_step_off"

    def __init__(self, *args, **kwargs):
        self._inflight_resampled = 0  # groups in flight at the restored checkpoint, sampled again by the next step
        super().__init__(*args, **kwargs)

    @property
    def inflight_resampled(self) -> int:
        """Groups in flight at the restored checkpoint, to be sampled again by the next step (0 once it ran)."""
        return self._inflight_resampled

    def _make_schedule(self):
        return AsyncSchedule(self._generate, self.training.train, self.training.sync, **self._schedule_args())

    def _schedule_args(self) -> dict:
        return dict(max_staleness=1, mode="one_step_off", deferrable=(RecoveryDeferred,),
                    last_step=self.spec.total_steps, waiting=self.training.driver_clock.waiting)

    def step(self, step: int, bar=None) -> StepOutcome:
        self._step, self._bar = step, None  # the phases overlap: no single phase to show
        return self.schedule.step(step, prefetch_next=step < self.spec.total_steps)

    def metrics(self, outcome: StepOutcome) -> dict:
        """``rollout/inflight_resampled`` (groups drawn before the restored checkpoint and sampled again now; 0 after
        the first step) and ``rollout/prefetch_deferred``."""
        resampled = 0 if outcome.prefetched else self._inflight_resampled
        self._inflight_resampled = 0
        return {"rollout/inflight_resampled": resampled,
                "rollout/prefetch_deferred": float(outcome.prefetch_deferred)}

    def sample_versions(self, batch: StepBatch) -> list[int] | None:
        return batch.group_versions

    def inflight(self) -> dict:
        """The position before the oldest batch generated but not trained (or the round carried over by partial
        rollouts, which comes after every queued batch), and the groups of every such batch and round, so the
        checkpoint records the data position of the trained batches only."""
        queued = self.schedule.queued
        carried = self.producer.carried()
        groups = sum(b.sampling.num_groups_sampled for b in queued) + (carried.num_groups if carried else 0)
        if queued:
            return {"position": queued[0].position, "groups": groups}
        if carried is not None:
            return {"position": carried.position, "groups": groups}
        return {"position": self.producer.position(), "groups": 0}

    def restore(self, path: Path) -> None:
        super().restore(path)
        self._inflight_resampled = inflight_groups(path)


class AsyncRollout(OneStepOffRollout):
    """``rollout.mode: async``: batches generated back to back, at most ``rollout.max_staleness`` versions ahead of
    the trainer; a queue whose head is too stale is dropped, its prompts drawn again. With
    ``rollout.partial_rollout`` the producer's call in flight is interrupted after each train step."""

    name = "async"

    def __init__(self, *args, **kwargs):
        self._stale_dropped_total = 0  # groups dropped for staleness in this run (kept by checkpoints)
        super().__init__(*args, **kwargs)

    @property
    def stale_dropped_total(self) -> int:
        """Groups dropped for staleness in the whole run (kept by checkpoints)."""
        return self._stale_dropped_total

    def _schedule_args(self) -> dict:
        interrupt = self.producer.interrupt if self.producer.partial is not None else None
        return dict(max_staleness=self.spec.rollout.max_staleness, mode="async", deferrable=(RecoveryDeferred,),
                    last_step=self.spec.total_steps, version=self.version, batch_version=batch_version,
                    drop=self._drop_stale, interrupt=interrupt, waiting=self.training.driver_clock.waiting)

    def _drop_stale(self, batches: list[StepBatch]) -> None:
        """The queued ``batches`` (oldest first) were dropped because the oldest is more than
        ``rollout.max_staleness`` versions behind: rewind the data position to the oldest one's, so their prompts
        are drawn again in the same order, and count their groups."""
        self.producer.rewind(batches[0].position)
        groups = sum(b.sampling.num_groups_sampled for b in batches)
        self._stale_dropped_total += groups
        self._status(f"step {self._step}: dropped {len(batches)} queued batch(es), {groups} group(s): the oldest "
                     f"was sampled by version {batch_version(batches[0])}, more than rollout.max_staleness="
                     f"{self.spec.rollout.max_staleness} behind version {self.version()}")

    def metrics(self, outcome: StepOutcome) -> dict:
        out = super().metrics(outcome)
        version_at_train = outcome.trained.version_at_train
        out.update(async_metrics(outcome.batch, version_at_train, outcome.dropped, outcome.queued,
                                 self._stale_dropped_total, self.spec.rollout.max_staleness))
        return out

    def state_dict(self) -> dict:
        return {"stale_dropped_total": self._stale_dropped_total}

    def restore(self, path: Path) -> None:
        super().restore(path)
        self._stale_dropped_total = stale_dropped_total(path)


#: ``rollout.mode`` → its strategy.
ROLLOUT_MODES: dict[str, type[SyncRollout]] = {"sync": SyncRollout, "one_step_off": OneStepOffRollout,
                                               "async": AsyncRollout}


def make_rollout(spec, producer: BatchProducer, training: TrainPhase, version: Callable[[], int],
                 status: Callable[[str], None]) -> SyncRollout:
    """The strategy of ``spec.rollout.mode``.

    Raises:
        ValueError: an unknown mode, naming ``rollout.mode`` and the known ones.
    """
    mode = spec.rollout.mode
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout.mode: expected one of {sorted(ROLLOUT_MODES)}, got {mode!r}")
    return ROLLOUT_MODES[mode](spec, producer, training, version, status)
