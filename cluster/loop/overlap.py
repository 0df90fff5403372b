"""When each step's rollout batch is generated relative to training: ``rollout.mode``.

A step is generate → train → sync. The schedules here order three callables and nothing else (no Ray, no engine,
no trainer), so the driver and the scripted-duration benchmark (``bench/bench_async.py``) run the same code:

* :class:`SyncSchedule` (``sync``): generate(k) → train(batch k) → sync. Engines idle while the trainer works and
  the other way round; every sample is on-policy (staleness 0). Step time ≈ generate + train + sync.
* :class:`OneStepOffSchedule` (``one_step_off``, as verl's one-step-off-policy trainer): while step k trains, a
  worker thread generates the batch of step k+1 on the engines' current weights (policy version v, the version step
  k trains from). When both have finished, the new weights (v+1) are synced; step k+1 then trains on that batch
  (staleness exactly 1) while the batch of k+2 is generated on v+1. Step time ≈ max(generate, train) + sync. The
  first step of a run (and of a resumed run) has no prefetched batch: it is generated first (staleness 0).

Nothing is generated while the weights are synced or between steps: the prefetch is joined before ``sync``, so
work done between steps (held-out evaluation, ``grpo-cluster scale``, a guard rollback, a checkpoint) never races an
in-flight generation. A prefetched batch that is not trained (the job stops, rolls back or is resumed from a
checkpoint) is dropped with :meth:`OneStepOffSchedule.discard`; its prompts are drawn again by whoever owns the data
position (a checkpoint records the position of the trained batches only).

A prefetch that raises one of ``deferrable`` (the driver's: :class:`cluster.loop.fleet.RecoveryDeferred`, an
engine fault that cannot be repaired while the trainer's weights change) is not an error: the step still trains and
syncs, nothing is pending, and the next step generates its batch itself after the sync, like a first step
(``StepOutcome.prefetch_deferred``). Whoever owns the data position puts the prefetch's prompts back.

Errors: any other exception from ``generate`` or ``train`` is raised after the other call has finished (the worker
thread is joined before :meth:`~OneStepOffSchedule.step` returns or raises, so no thread outlives a step); with both
failing, the ``train`` error is raised and the ``generate`` one chained as its context.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = ["OneStepOffSchedule", "RolloutMode", "StepOutcome", "SyncSchedule", "make_schedule"]

RolloutMode = Literal["sync", "one_step_off"]
B = TypeVar("B")  # a generated batch
R = TypeVar("R")  # a train result
S = TypeVar("S")  # a sync result


@dataclass
class StepOutcome(Generic[B, R, S]):
    """One step's results.

    Attributes:
        step: the step (1-based). batch: what it trained on (``generate(step)``'s result). trained: ``train(batch)``.
        synced: ``sync(trained)``. prefetched: the batch was generated during the previous step (one_step_off).
        prefetch_deferred: the next step's prefetch raised a ``deferrable`` error and was dropped.
    """

    step: int
    batch: B
    trained: R
    synced: S
    prefetched: bool
    prefetch_deferred: bool = False


class SyncSchedule(Generic[B, R, S]):
    """``sync``: generate(k) → train → sync, one after the other.

    Args:
        generate: step → that step's batch. train: batch → result. sync: result → the sync's result.
    """

    mode: RolloutMode = "sync"

    def __init__(self, generate: Callable[[int], B], train: Callable[[B], R], sync: Callable[[R], S]):
        self.generate, self.train, self.sync = generate, train, sync

    @property
    def pending(self) -> B | None:
        """The batch generated ahead of its step: never one in ``sync``."""
        return None

    def step(self, step: int, prefetch_next: bool = False) -> StepOutcome[B, R, S]:
        """Run step ``step``; ``prefetch_next`` is ignored (nothing is generated ahead)."""
        batch = self.generate(step)
        trained = self.train(batch)
        return StepOutcome(step, batch, trained, self.sync(trained), prefetched=False)

    def discard(self) -> B | None:
        """Nothing is ever prefetched: returns None."""
        return None


class OneStepOffSchedule(Generic[B, R, S]):
    """``one_step_off``: generate(k+1) in a worker thread while train(batch k) runs; sync when both are done.

    Args:
        generate: step → that step's batch, on the engines' current weights. Runs in a worker thread while
            ``train`` runs in the caller's, so the two must not share unsynchronised state (the driver's generate
            touches the engines, the prompt queue and the scorer; its train touches the train ranks).
        train: batch → result (the policy update). sync: result → the sync's result (new weights to the engines).
        deferrable: exception types of a prefetch that drop it instead of failing the step (see the module).
    """

    mode: RolloutMode = "one_step_off"

    def __init__(self, generate: Callable[[int], B], train: Callable[[B], R], sync: Callable[[R], S],
                 deferrable: tuple[type[BaseException], ...] = ()):
        self.generate, self.train, self.sync, self.deferrable = generate, train, sync, deferrable
        self._pending: tuple[int, B] | None = None  # (step, batch) generated ahead of that step

    @property
    def pending(self) -> B | None:
        """The batch generated for the next step and not yet trained (None when there is none)."""
        return self._pending[1] if self._pending is not None else None

    def step(self, step: int, prefetch_next: bool = True) -> StepOutcome[B, R, S]:
        """Train step ``step`` on its batch (the prefetched one when it was generated for ``step``, else generated
        now) while generating the batch of ``step + 1`` (when ``prefetch_next``); then sync.

        Raises:
            ValueError: a batch is pending for another step (nothing run; :meth:`discard` it first, so its prompts
                are not dropped unseen).
            whatever ``generate``, ``train`` or ``sync`` raise; after a failure nothing stays pending.
        """
        if self._pending is not None and self._pending[0] != step:
            raise ValueError(f"step {step}: the batch pending was generated for step {self._pending[0]}; discard() "
                             f"it first")
        prefetched = self._pending is not None and self._pending[0] == step
        batch = self._pending[1] if prefetched else self.generate(step)
        self._pending = None
        next_batch = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"one-step-off-generate-{step + 1}") as worker:
            future = worker.submit(self.generate, step + 1) if prefetch_next else None
            try:
                trained = self.train(batch)
            except BaseException as train_error:
                generate_error = future.exception() if future is not None else None  # waits for generate to end
                if generate_error is not None and train_error.__context__ is None:
                    train_error.__context__ = generate_error
                raise
            deferred = False
            if future is not None:
                try:
                    next_batch = future.result()  # waits; raises generate's error
                except self.deferrable:
                    deferred = True
        synced = self.sync(trained)
        if prefetch_next and not deferred:
            self._pending = (step + 1, next_batch)
        return StepOutcome(step, batch, trained, synced, prefetched=prefetched, prefetch_deferred=deferred)

    def discard(self) -> B | None:
        """Drop the prefetched batch (a rollback or a stop); returns it (None when there was none)."""
        batch, self._pending = self.pending, None
        return batch


def make_schedule(mode: RolloutMode, generate: Callable[[int], B], train: Callable[[B], R],
                  sync: Callable[[R], S], deferrable: tuple[type[BaseException], ...] = ()
                  ) -> SyncSchedule[B, R, S] | OneStepOffSchedule[B, R, S]:
    """The schedule of ``rollout.mode`` (``deferrable``: see :class:`OneStepOffSchedule`; unused by ``sync``).

    Raises:
        ValueError: an unknown mode (expected 'sync' or 'one_step_off').
    """
    if mode == "sync":
        return SyncSchedule(generate, train, sync)
    if mode == "one_step_off":
        return OneStepOffSchedule(generate, train, sync, deferrable)
    raise ValueError(f"rollout.mode: expected one of ['one_step_off', 'sync'], got {mode!r}")
