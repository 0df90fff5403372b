"""When each step's rollout batch is generated relative to training: ``rollout.mode``.

A step is generate → train → sync. The schedules here order three callables and nothing else (no Ray, no engine,
no trainer), so the driver and the scripted-duration benchmark (``bench/bench_async.py``) run the same code:

* :class:`SyncSchedule` (``sync``): generate(k) → train(batch k) → sync. Engines idle while the trainer works and
  the other way round; every sample is on-policy (staleness 0). Step time ≈ generate + train + sync.
* :class:`AsyncSchedule` (``async`` with ``rollout.max_staleness`` k >= 1, in the style of verl's fully-async trainer
  and AReaL's bounded off-policyness): while step k trains, a producer thread generates batches back to back into a
  bounded queue, as many as keep every queued batch within k policy versions of the trainer that will train it. A
  batch generated while the trainer holds version v and n batches are already queued is trained at version v + 1 + n,
  so the producer starts one only while n < k (staleness 1 + n <= k); the engines idle only while the queue is full.
  Step time ≈ max(generate, train) + sync when generation keeps up.
* ``one_step_off`` (as verl's one-step-off-policy trainer) is the same schedule with k = 1
  (``make_schedule("one_step_off", ...)``: an :class:`AsyncSchedule` whose ``mode`` is ``"one_step_off"``): while
  step k trains, the producer generates the batch of step k+1 on the engines' current weights (policy version v, the
  version step k trains from) and stops, the queue being full. When both have finished, the new weights (v+1) are
  synced; step k+1 then trains on that batch (staleness exactly 1) while the batch of k+2 is generated on v+1.

Step k trains the queue's head (generated now, on-policy, in the caller's thread, when the queue is empty: the first
step of a run or of a resumed run has no prefetched batch, staleness 0). The producer's first call of a step always
starts (when the queue and ``last_step`` allow one), however soon ``train`` ends, so which batches are prefetched does
not depend on thread timing. Before training, the head's staleness (``version()`` − ``batch_version(head)``) is
checked again: a head more than k behind (only when the trainer advanced more than one version per step) is dropped
with every batch queued after it, ``drop(batches)`` is told (its owner rewinds the data position to the oldest one's:
their prompts are drawn again in the same order, none lost, none trained twice) and the step generates its batch
itself.

Weight sync happens at a generation boundary: after ``train`` the producer finishes its current generate call and
stops, the new weights are synced, and the next step starts it again. So a step lasts at least until the slowest
generate call that started during it ends (a weight update waits for the longest completion) — unless partial
rollouts are on (below). Nothing is generated while the weights are synced or between steps: the producer is joined
before ``sync``, so work done between steps (held-out evaluation, ``grpo-cluster scale``, a guard rollback, a
checkpoint) never races an in-flight generation. Batches generated and not trained (the job stops, rolls back or is
resumed from a checkpoint) are dropped with :meth:`AsyncSchedule.discard`; their prompts are drawn again by whoever
owns the data position (a checkpoint records the position of the trained batches only).

A producer call that raises one of ``deferrable`` (the driver's: :class:`cluster.ray_shell.fleet.RecoveryDeferred`, an
engine fault that cannot be repaired while the trainer's weights change) is not an error: it stops the producer for
the step (the batches queued before it stay), the step still trains and syncs (``StepOutcome.prefetch_deferred``), and
a step whose queue is empty generates its batch itself after the sync, like a first step. Whoever owns the data
position puts the deferred call's prompts back.

Errors: any other exception from ``generate`` or ``train`` is raised after the other call has finished (the producer
thread is joined before :meth:`~AsyncSchedule.step` returns or raises, so no thread outlives a step); with both
failing, the ``train`` error is raised and the ``generate`` one chained as its context. After any error nothing stays
queued (the caller owns the data position).

Partial rollouts (``rollout.partial_rollout``; AReaL's interruptible rollout, PipelineRL's in-flight weight updates,
slime's partial rollouts): :class:`AsyncSchedule` is given ``interrupt``. After ``train`` (or when it fails) it calls
``interrupt()`` instead of letting the producer's generate call run to its end; the call stops at its engines' next
step and raises :class:`GenerateInterrupted`, which stops the producer for the step like a deferral
(``StepOutcome.interrupted``). What the interrupted call had sampled is kept by whoever owns the generate callable
(the driver: the interrupted groups, their prompts and data position) and continued by the next call for the same
step, after the sync, on the new weights; complete groups are only those whose G completions all finished. The
schedule itself keeps nothing of it, so the invariants stay: the producer is joined before ``sync``, nothing is in
flight between steps, and a checkpoint taken then counts the carried-over groups as in flight (the owner's
``inflight`` record: resampled from scratch on resume).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

__all__ = ["AsyncSchedule", "GenerateInterrupted", "RolloutMode", "StepOutcome", "SyncSchedule", "make_schedule"]

RolloutMode = Literal["sync", "one_step_off", "async"]
B = TypeVar("B")  # a generated batch
R = TypeVar("R")  # a train result
S = TypeVar("S")  # a sync result


class GenerateInterrupted(Exception):
    """Raised by a producer's ``generate`` call that ``interrupt()`` stopped early (partial rollouts). Its caller
    keeps what was sampled, to continue it in the next call for the same step; the schedule only stops the producer
    for the step."""


@dataclass
class StepOutcome(Generic[B, R, S]):
    """One step's results.

    Attributes:
        step: the step (1-based). batch: what it trained on (``generate(step)``'s result). trained: ``train(batch)``.
        synced: ``sync(trained)``. prefetched: the batch was generated during the previous step (one_step_off, async).
        prefetch_deferred: the next step's prefetch raised a ``deferrable`` error and was dropped.
        dropped: (async, one_step_off) the queued batches dropped before this step because the head was more than
            ``max_staleness`` versions behind, oldest first. queued: (async, one_step_off) batches queued for later
            steps when the step ended. interrupted: (async, partial rollouts) the producer's generate call was
            interrupted after ``train`` (its owner carries its groups over to the next step).
    """

    step: int
    batch: B
    trained: R
    synced: S
    prefetched: bool
    prefetch_deferred: bool = False
    dropped: list = field(default_factory=list)
    queued: int = 0
    interrupted: bool = False


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

    @property
    def queued(self) -> list[B]:
        """Batches generated ahead of their steps, oldest first: none in ``sync``."""
        return []

    def step(self, step: int, prefetch_next: bool = False) -> StepOutcome[B, R, S]:
        """Run step ``step``; ``prefetch_next`` is ignored (nothing is generated ahead)."""
        batch = self.generate(step)
        trained = self.train(batch)
        return StepOutcome(step, batch, trained, self.sync(trained), prefetched=False)

    def discard(self) -> B | None:
        """Nothing is ever prefetched: returns None."""
        return None


class AsyncSchedule(Generic[B, R, S]):
    """``async`` and ``one_step_off``: a producer thread generates batches into a bounded queue while each step trains
    (see the module).

    Args:
        generate: step → that step's batch, on the engines' current weights. Runs in the producer thread while
            ``train`` runs in the caller's (and in the caller's when the queue is empty at a step's start), so the two
            must not share unsynchronised state (the driver's generate touches the engines, the prompt queue and the
            scorer; its train touches the train ranks).
        train: batch → result (the policy update). sync: result → the sync's result (new weights to the engines).
        max_staleness: k >= 1, the most policy versions a trained batch may be behind the trainer (the queue bound).
        version: → the trainer's current policy version (read before each step trains). batch_version: batch → the
            oldest policy version that sampled any of its samples. drop: called with the batches dropped for
            staleness (oldest first) before the step generates again; it puts their prompts back (the data position
            of the oldest). All three or none: None skips the staleness check (one version per step and the queue
            bound already keep every batch within k).
        last_step: no batch is generated for a later step (the run's ``total_steps``); None: no limit.
        deferrable: exception types of a producer call that stop the producer for the step instead of failing it.
        interrupt: (partial rollouts) called once ``train`` has ended (or failed) while the producer is still
            running: it must make the producer's generate call in flight, and any the producer starts before it
            sees the stop, raise :class:`GenerateInterrupted` soon (the driver: interrupt every engine). None: the
            producer's call runs to its end (a weight update waits for the longest completion).
        mode: ``"async"``, or ``"one_step_off"`` (then ``max_staleness`` must be 1): the ``rollout.mode`` the caller
            reports (the driver keys the async-only metrics and checkpoint fields on it); the schedule is the same.
        waiting: → a context manager around the caller's wait for the producer once ``train`` has ended (the
            driver's goodput clock counts it as a wait on the engines); None: nothing around it.
    Raises:
        ValueError: ``max_staleness`` < 1; mode ``one_step_off`` with ``max_staleness`` != 1; another mode; some but
            not all of ``version``, ``batch_version``, ``drop``.
    """

    def __init__(self, generate: Callable[[int], B], train: Callable[[B], R], sync: Callable[[R], S], *,
                 max_staleness: int, version: Callable[[], int] | None = None,
                 batch_version: Callable[[B], int] | None = None, drop: Callable[[list[B]], None] | None = None,
                 last_step: int | None = None, deferrable: tuple[type[BaseException], ...] = (),
                 interrupt: Callable[[], None] | None = None, mode: RolloutMode = "async",
                 waiting: Callable[[], contextlib.AbstractContextManager] | None = None):
        if mode not in ("async", "one_step_off"):
            raise ValueError(f"AsyncSchedule: expected mode 'async' or 'one_step_off', got {mode!r}")
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness: mode {mode!r} needs >= 1, got {max_staleness}")
        if mode == "one_step_off" and max_staleness != 1:
            raise ValueError(f"mode 'one_step_off' is async with max_staleness 1, got max_staleness {max_staleness}")
        if len({version is None, batch_version is None, drop is None}) != 1:
            raise ValueError("AsyncSchedule: give all of version, batch_version and drop (the staleness check) or none")
        self.mode: RolloutMode = mode
        self.generate, self.train, self.sync, self.deferrable = generate, train, sync, deferrable
        self.max_staleness, self.version, self.batch_version, self.drop = max_staleness, version, batch_version, drop
        self.last_step, self.interrupt = last_step, interrupt
        self.waiting = waiting if waiting is not None else contextlib.nullcontext
        self._interrupted = False  # the running step's producer call was interrupted
        self._queue: deque[tuple[int, B]] = deque()  # (the step that will train it, batch), oldest first
        self._stop = threading.Event()  # set: the producer starts no further generate call

    @property
    def pending(self) -> B | None:
        """The oldest queued batch (the next step's), None when the queue is empty."""
        return self._queue[0][1] if self._queue else None

    @property
    def queued(self) -> list[B]:
        """Every queued batch, oldest first: a snapshot, safe to read while the producer appends (``list(deque)``
        copies in one C call under the GIL; iterating the deque itself raises 'deque mutated during iteration')."""
        return [batch for _, batch in list(self._queue)]

    def step(self, step: int, prefetch_next: bool = True) -> StepOutcome[B, R, S]:
        """Train step ``step`` on the queue's head (after dropping it and the rest if it is more than
        ``max_staleness`` behind; generated now when the queue is empty) while the producer fills the queue for the
        steps after it (when ``prefetch_next``); then stop the producer at its next generation boundary (with
        ``interrupt``: interrupt its call in flight) and sync.

        Raises:
            ValueError: the head was generated for another step (nothing run; :meth:`discard` first).
            whatever ``generate``, ``train``, ``sync``, ``drop`` or ``interrupt`` raise (:class:`GenerateInterrupted`
            too, from a call made in the caller's thread: only the producer's calls may be interrupted); after a
            failure nothing stays queued.
        """
        if self._queue and self._queue[0][0] != step:
            raise ValueError(f"step {step}: the queued head was generated for step {self._queue[0][0]}; discard() "
                             f"the queue first")
        try:
            dropped = self._drop_stale()
            prefetched = bool(self._queue)
            batch = self._queue.popleft()[1] if prefetched else self.generate(step)
            trained, deferred = self._train_while_producing(step, batch, prefetch_next)
            synced = self.sync(trained)
        except BaseException:
            self._queue.clear()
            raise
        return StepOutcome(step, batch, trained, synced, prefetched=prefetched, prefetch_deferred=deferred,
                           dropped=dropped, queued=len(self._queue), interrupted=self._interrupted)

    def _drop_stale(self) -> list[B]:
        """Drop the whole queue when its head is more than ``max_staleness`` versions behind (versions never
        decrease along the queue, so a stale batch is always at the head); returns what was dropped."""
        if (self.version is None or not self._queue
                or self.version() - self.batch_version(self._queue[0][1]) <= self.max_staleness):
            return []
        dropped = self.discard()
        self.drop(dropped)
        return dropped

    def _train_while_producing(self, step: int, batch: B, produce: bool) -> tuple[R, bool]:
        """``train(batch)`` in the caller's thread while the producer thread fills the queue; the producer is
        stopped and joined (after its current generate call) before this returns or raises. Returns (train's
        result, whether the producer stopped on a ``deferrable`` error). With ``interrupt``, the producer's call in
        flight is interrupted instead of awaited."""
        self._stop.clear()
        self._interrupted = False
        last = self.last_step if produce else step
        prefix = f"{self.mode.replace('_', '-')}-producer-{step}"  # async-producer-k, one-step-off-producer-k
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix) as worker:
            future = worker.submit(self._produce, step + 1 + len(self._queue), last)
            try:
                trained = self.train(batch)
            except BaseException as train_error:
                self._stop.set()
                with contextlib.suppress(Exception):  # the train error is the one raised
                    self._interrupt_producer(future)
                produce_error = future.exception()  # waits for the current generate call to end
                if produce_error is not None and train_error.__context__ is None:
                    train_error.__context__ = produce_error
                raise
            self._stop.set()
            try:
                self._interrupt_producer(future)
            except BaseException:
                future.exception()  # no thread outlives the step: wait for the call to end, then raise
                raise
            try:
                with self.waiting():
                    future.result()  # waits for the current generate call to end; raises its error
            except self.deferrable:
                return trained, True
        return trained, False

    def _interrupt_producer(self, future) -> None:
        """Call ``interrupt`` (when given) if the producer is still running."""
        if self.interrupt is not None and not future.done():
            self.interrupt()

    def _produce(self, next_step: int, last_step: int | None) -> None:
        """Generate the batches of ``next_step``, ``next_step`` + 1, … back to back while the queue holds fewer than
        ``max_staleness`` batches, up to ``last_step``, until :attr:`_stop` is set. :attr:`_stop` is read after each
        call, so the first call always starts (however soon ``train`` ends: what is prefetched does not depend on
        thread timing)."""
        while len(self._queue) < self.max_staleness and (last_step is None or next_step <= last_step):
            try:
                batch = self.generate(next_step)
            except GenerateInterrupted:
                self._interrupted = True
                return
            self._queue.append((next_step, batch))
            next_step += 1
            if self._stop.is_set():
                return

    def discard(self) -> list[B]:
        """Drop every queued batch (a rollback, a stop or a stale head); returns them, oldest first."""
        batches = self.queued
        self._queue.clear()
        return batches


def make_schedule(mode: RolloutMode, generate: Callable[[int], B], train: Callable[[B], R],
                  sync: Callable[[R], S], deferrable: tuple[type[BaseException], ...] = (), **async_args
                  ) -> SyncSchedule[B, R, S] | AsyncSchedule[B, R, S]:
    """The schedule of ``rollout.mode``: :class:`SyncSchedule`, or :class:`AsyncSchedule` for ``async`` and for
    ``one_step_off`` (async with ``max_staleness`` 1, whatever ``async_args`` says). ``deferrable``: see
    :class:`AsyncSchedule`; unused by ``sync``. ``async_args``: :class:`AsyncSchedule`'s keyword arguments
    (``max_staleness``, ``version``, ``batch_version``, ``drop``, ``last_step``, ``interrupt``, ``waiting``), ignored
    by ``sync``.

    Raises:
        ValueError: an unknown mode (expected 'async', 'one_step_off' or 'sync'); AsyncSchedule's errors.
    """
    if mode == "sync":
        return SyncSchedule(generate, train, sync)
    if mode == "one_step_off":
        return AsyncSchedule(generate, train, sync, deferrable=deferrable, mode=mode,
                             **{**async_args, "max_staleness": 1})
    if mode == "async":
        return AsyncSchedule(generate, train, sync, deferrable=deferrable, **async_args)
    raise ValueError(f"rollout.mode: expected one of ['async', 'one_step_off', 'sync'], got {mode!r}")
