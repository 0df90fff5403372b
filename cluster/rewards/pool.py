"""A reward pool over workers of any runtime (``contract.protocols.RewardPool``): :class:`WorkerPool` keeps one
driver-side thread per worker, feeds them batched calls from one queue, enforces the per-call timeout and replaces a
worker that died or timed out.

    pool = WorkerPool(make_worker, workers=2, batch_size=64, timeout_s=60, kind="local processes")
    pool.start()
    ticket = pool.submit(calls)              # returns at once; the threads send the chunks to the workers
    scores = pool.collect(ticket, 900.0)     # one RewardScores per call, in order

The runtime gives a factory of workers (:class:`RewardWorker`: ``cluster.ray_shell.reward_pool`` makes Ray actors,
``cluster.in_process.reward_pool`` local processes or threads). Failure semantics (``docs/own_task.md``):

- a worker that dies during a call, or does not answer within ``timeout_s`` seconds of receiving it, loses that call:
  every row of the chunk gets no score (NaN: an infrastructure failure, counted in ``reward/infra_failed`` and in
  ``reward/failed``); the worker is killed and a new one started in its place before its thread takes the next chunk;
- a reward error (a broken contract, or a raise with ``algorithm.reward_on_error: raise``) fails the collect with the
  error as the worker raised it;
- :meth:`WorkerPool.collect` waits at most its ``timeout_s``; chunks not scored by then get no score.

Threads: :meth:`submit` and :meth:`collect` may be called from any one thread at a time (the driver's, or the
schedule's producer thread); the pool's own threads only take chunks and fill tickets, under its lock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from cluster.rewards.calls import Chunk, join_scores, lost_scores, pack_chunks, split_chunk_scores
from cluster.worker_start import start_workers
from contract.goodput import PoolTime
from contract.rewards import RewardCall, RewardScores, RewardTicket
from grpo.rewards.calling import RewardError

__all__ = ["RewardWorker", "WorkerLost", "WorkerPool"]

logger = logging.getLogger(__name__)
_STOP = object()


class WorkerLost(RuntimeError):
    """A reward worker died during a call or did not answer within the per-call timeout.

    Attributes:
        timed_out: True for a timeout, False for a death.
    """

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class RewardWorker(Protocol):
    """One started worker of a runtime, with the job's reward functions loaded."""

    def call(self, call: RewardCall, timeout_s: float) -> RewardScores:
        """Score ``call`` on the worker.

        Raises:
            WorkerLost: it died, or gave no answer within ``timeout_s`` seconds.
            RewardError: a reward error raised in the worker (``cluster.rewards.worker.raise_wire_error``).
        """
        ...

    def close(self) -> None:
        """Kill the worker (idempotent; a call in progress ends with :class:`WorkerLost`)."""
        ...


class _Pending:
    """A submitted ticket's state: each call's scored segments, chunks still out, the first error."""

    def __init__(self, ticket: RewardTicket, chunks: list[Chunk], weights: Sequence[str]):
        self.ticket, self.chunks, self.weights = ticket, chunks, list(weights)
        self.parts: list[list] = [[] for _ in ticket.sizes]
        self.done: set[int] = set()  # indices of finished chunks
        self.error: BaseException | None = None
        self.closed = False  # collected or abandoned: late results are dropped

    def finished(self) -> bool:
        return self.error is not None or len(self.done) == len(self.chunks)


class WorkerPool:
    """A reward pool of ``workers`` workers made by ``make_worker`` (module docstring).

    Args:
        make_worker: ``make_worker(index)`` → a started :class:`RewardWorker` (blocks until it is ready; raises
            when it cannot start: a RewardError naming a function that does not load, or the runtime's error).
        workers: how many (>= 1). batch_size: completions per worker call. timeout_s: seconds one call may take.
        kind: what the workers are, for :meth:`describe` (e.g. ``"Ray actors"``).
        cores_per_worker: CPU cores each worker holds (its Ray resources), for :meth:`pool_times`; 0: the driver's.
    """

    def __init__(self, make_worker: Callable[[int], RewardWorker], workers: int, batch_size: int, timeout_s: float,
                 kind: str, cores_per_worker: float = 0.0):
        if workers < 1:
            raise ValueError(f"a worker pool needs workers >= 1, got {workers}")
        self.make_worker, self.workers, self.batch_size, self.timeout_s, self.kind = (
            make_worker, workers, batch_size, timeout_s, kind)
        self.cores_per_worker = cores_per_worker
        self._busy_s = 0.0  # worker-seconds in calls, lost ones included
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._slots: list[RewardWorker | None] = []
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._closing = False
        self.counts = {"worker_restarts": 0, "timed_out_calls": 0, "lost_calls": 0, "lost_rows": 0}

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker (in parallel) and its thread; idempotent.

        Raises:
            the first error of a worker that could not start (every worker started is stopped again).
        """
        if self._threads:
            return
        self._closing = False
        self._queue = queue.Queue()  # nothing of an earlier run (abandoned chunks, stop marks)
        self._slots = list(start_workers(self.make_worker, self.workers, "reward-start"))
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"reward-pool-{i}", daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def shutdown(self) -> None:
        """Stop the threads and the workers (idempotent); tickets not collected get no scores."""
        if not self._threads:
            return
        self._closing = True
        for _ in self._threads:
            self._queue.put(_STOP)
        self._close_workers()  # a call in progress ends now (WorkerLost), so its thread sees _STOP next
        for t in self._threads:
            t.join(timeout=30)
        self._close_workers()  # one a thread started while the pool closed
        self._threads = []
        with self._lock:
            for p in self._pending.values():
                p.closed = True
            self._pending.clear()
            self._lock.notify_all()

    def _close_workers(self) -> None:
        for i, worker in enumerate(self._slots):
            if worker is not None:
                worker.close()
                self._slots[i] = None

    # ---- the protocol -----------------------------------------------------------------------------------------
    def submit(self, calls: Sequence[RewardCall]) -> RewardTicket:
        """Queue ``calls`` (packed into chunks of ``batch_size`` rows) and return at once.

        Raises:
            RuntimeError: the pool is not started.
        """
        if not self._threads:
            raise RuntimeError("reward pool: submit before start() (or after shutdown())")
        ticket = RewardTicket(next(self._ids), tuple(len(c) for c in calls))
        chunks = pack_chunks(calls, self.batch_size)
        pending = _Pending(ticket, chunks, calls[0].weights if calls else {})
        with self._lock:
            self._pending[ticket.ticket_id] = pending
        for index in range(len(chunks)):
            self._queue.put((pending, index))
        return ticket

    def collect(self, ticket: RewardTicket, timeout_s: float) -> list[RewardScores]:
        """``ticket``'s scores, one per call in submission order (module docstring for what is lost when).

        Raises:
            RewardError: raised by a worker for one of its chunks. KeyError: an unknown (or collected) ticket.
        """
        with self._lock:
            pending = self._pending[ticket.ticket_id]
            self._lock.wait_for(pending.finished, timeout=timeout_s)
            del self._pending[ticket.ticket_id]
            pending.closed = True
            if pending.error is not None:
                raise pending.error
            missing = [i for i in range(len(pending.chunks)) if i not in pending.done]
        for index in missing:
            logger.warning("reward pool: a chunk of %d completions was not scored within %g s; its rows get no "
                           "score", len(pending.chunks[index].call), timeout_s)
            with self._lock:
                self.counts["lost_rows"] += len(pending.chunks[index].call)  # lost to this step as well
            self._fill(pending, index, lost_scores(len(pending.chunks[index].call), pending.weights), force=True)
        return [join_scores([scores for _, scores in sorted(parts, key=lambda p: p[0].start)]) if parts
                else lost_scores(0, pending.weights) for parts in pending.parts]

    def metrics(self) -> dict[str, float]:
        """``reward_pool/workers`` and the cumulative ``reward_pool/{worker_restarts, timed_out_calls, lost_calls,
        lost_rows}`` (lost: calls whose worker died or timed out; ``lost_rows``: their rows and the rows of chunks a
        step stopped waiting for, every row the pool gave no score)."""
        return {"reward_pool/workers": float(self.workers),
                **{f"reward_pool/{k}": float(v) for k, v in self.counts.items()}}

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the workers (pool ``reward``, none before :meth:`start`) and the seconds
        their calls took so far (a lost call's until it was given up)."""
        serving = self.workers if self._threads else 0
        with self._lock:
            busy = self._busy_s
        return [PoolTime("reward", serving, busy, cores=serving * self.cores_per_worker)]

    def describe(self) -> str:
        return (f"{self.workers} reward worker(s) ({self.kind}, {self.batch_size} completions per call, "
                f"{self.timeout_s:g} s timeout)")

    # ---- the workers' threads ---------------------------------------------------------------------------------
    def _fill(self, pending: _Pending, index: int, scores: RewardScores, force: bool = False) -> None:
        with self._lock:
            if (pending.closed and not force) or index in pending.done:
                return
            for segment, part in split_chunk_scores(pending.chunks[index], scores):
                pending.parts[segment.call_index].append((segment, part))
            pending.done.add(index)
            self._lock.notify_all()

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        with self._lock:
            if pending.error is None:
                pending.error = error
            self._lock.notify_all()

    def _serve(self, slot: int) -> None:
        """Slot ``slot``'s thread: take chunks, call the worker, replace it when it is lost."""
        while True:
            item = self._queue.get()
            if item is _STOP or self._closing:
                return
            pending, index = item
            if pending.closed or pending.error is not None:
                continue
            call = pending.chunks[index].call
            try:
                scores = self._call(slot, call)
            except RewardError as exc:
                self._fail(pending, exc)
                continue
            self._fill(pending, index, scores)

    def _call(self, slot: int, call: RewardCall) -> RewardScores:
        """One chunk on slot ``slot``'s worker; a lost call's scores are NaN."""
        t0 = time.perf_counter()
        try:
            worker = self._slots[slot] or self._restart(slot)
            return worker.call(call, self.timeout_s)
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 - WorkerLost, or a worker that cannot start / be reached
            self._lost(slot, call, exc)
            return lost_scores(len(call), call.weights)
        finally:
            with self._lock:
                self._busy_s += time.perf_counter() - t0

    def _restart(self, slot: int) -> RewardWorker:
        """A new worker in slot ``slot`` (counted in ``reward_pool/worker_restarts``).

        Raises:
            WorkerLost: the pool is shutting down. The factory's errors (it could not start).
        """
        if self._closing:
            raise WorkerLost("the pool is shutting down")
        worker = self._slots[slot] = self.make_worker(slot)
        with self._lock:
            self.counts["worker_restarts"] += 1
        return worker

    def _lost(self, slot: int, call: RewardCall, exc: Exception) -> None:
        """Count the lost call, kill the slot's worker and start its replacement now (a replacement that cannot
        start is tried again before the slot's next call)."""
        timed_out = isinstance(exc, WorkerLost) and exc.timed_out
        with self._lock:
            self.counts["timed_out_calls" if timed_out else "lost_calls"] += 1
            self.counts["lost_rows"] += len(call)
        if self._closing:
            return
        logger.warning("reward pool: worker %d lost a call of %d completions (%s: %s); its rows get no score, the "
                       "worker is replaced", slot, len(call), type(exc).__name__, exc)
        worker, self._slots[slot] = self._slots[slot], None
        if worker is not None:
            worker.close()
        try:
            self._restart(slot)
        except Exception as restart_error:  # noqa: BLE001 - tried again before the slot's next call
            logger.warning("reward pool: worker %d could not be replaced (%s: %s); trying again before its next call",
                           slot, type(restart_error).__name__, restart_error)
