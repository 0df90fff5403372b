"""The agent pool over workers of any runtime (``contract.agents.AgentPool``): :class:`AgentWorkerPool` sends each
episode to the least busy worker with a free slot (``rollout.agent_pool.episodes_per_worker`` at once), resolves its
future with the worker's outcome, and replaces a worker that died or went silent.

    pool = AgentWorkerPool(make_worker, workers=2, episodes_per_worker=16, timeout_s=600, kind="local processes")
    pool.start()
    future = pool.submit(ticket)           # returns at once; future.result() is the episode's AgentOutcome
    pool.shutdown()

The runtime gives a factory of workers (:class:`AgentWorker`: ``cluster.ray_shell.agent_pool`` makes Ray actors,
``cluster.in_process.agent_pool`` local processes). Failure semantics (docs/agents.md):

- the worker enforces ``timeout_s`` on each episode itself (cancelling it: an infrastructure failure of that
  episode);
- a worker that dies (its process killed, ``os._exit`` in an agent, its node lost), or that does not finish an
  episode within ``timeout_s`` + :data:`GRACE_S` (its event loop is blocked: a synchronous sleep or computation in the
  agent), loses every episode it was running: each ends as an infrastructure failure (no reward, counted), with a
  one-line reason in the log; the worker is killed and a new one takes its slot;
- the futures never raise: every episode ends as an outcome, also when the pool shuts down under it.

Threads: :meth:`AgentWorkerPool.submit` may be called from any thread; the workers' callbacks, the watchdog and the
restarts run in threads of their own, under the pool's lock.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from cluster.worker_start import start_workers
from contract.agents import AgentOutcome, EpisodeTicket
from contract.goodput import PoolTime

__all__ = ["GRACE_S", "AgentWorker", "AgentWorkerLost", "AgentWorkerPool", "infra_outcome"]

logger = logging.getLogger(__name__)

#: Seconds past ``rollout.agent_pool.timeout_s`` after which a worker that has not finished an episode is taken for
#: hung (its own timeout should have ended the episode) and replaced.
GRACE_S = 10.0


class AgentWorkerLost(RuntimeError):
    """An agent worker died, or could not be reached; its episodes are lost."""


class AgentWorker(Protocol):
    """One started worker of a runtime, with the job's agent loaded."""

    def run(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Start one episode on the worker and return at once; the future resolves with its outcome, or raises
        :class:`AgentWorkerLost` when the worker dies first."""
        ...

    def close(self) -> None:
        """Kill the worker (idempotent; its running episodes' futures raise :class:`AgentWorkerLost`)."""
        ...


def infra_outcome(detail: str) -> AgentOutcome:
    """An episode lost to the infrastructure (``failure`` ``"infra"``, no reward)."""
    return AgentOutcome(None, failure="infra", detail=detail, ended="infra_failed")


@dataclass
class _Running:
    ticket: EpisodeTicket
    future: Future
    deadline: float


@dataclass
class _Slot:
    worker: AgentWorker | None = None
    generation: int = 0  # bumped when its worker is lost: late callbacks of the old worker are ignored
    running: dict[int, _Running] = field(default_factory=dict)
    busy_since: float | None = None  # monotonic time its first running episode started; None while it runs none


class AgentWorkerPool:
    """An agent pool of ``workers`` workers made by ``make_worker`` (module docstring).

    Args:
        make_worker: ``make_worker(index)`` → a started :class:`AgentWorker` (blocks until it is ready; raises when it
            cannot start: ``cluster.agents.loading.AgentLoadError`` naming the agent's file, or the runtime's error).
        workers: how many (>= 1). episodes_per_worker: episodes one worker runs at once (>= 1).
        timeout_s: ``rollout.agent_pool.timeout_s`` (the worker's own per-episode limit).
        kind: what the workers are, for :meth:`describe` (e.g. ``"Ray actors"``).
        grace_s: seconds past ``timeout_s`` before a silent worker is replaced (:data:`GRACE_S`).
        cores_per_worker: CPU cores each worker holds (its Ray resources), for :meth:`pool_times`; 0: the driver's.
    """

    def __init__(self, make_worker: Callable[[int], AgentWorker], workers: int, episodes_per_worker: int,
                 timeout_s: float, kind: str, grace_s: float = GRACE_S, cores_per_worker: float = 0.0):
        if workers < 1 or episodes_per_worker < 1:
            raise ValueError(f"an agent pool needs workers >= 1 and episodes_per_worker >= 1, got {workers} and "
                             f"{episodes_per_worker}")
        self.make_worker = make_worker
        self.workers = workers
        self.per_worker = episodes_per_worker
        self.timeout_s = timeout_s
        self.kind = kind
        self.grace_s = grace_s
        self._lock = threading.RLock()
        self._slots: list[_Slot] = []
        self._waiting: deque[tuple[EpisodeTicket, Future]] = deque()
        self._ids = itertools.count()
        self._started = self._closing = False
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.counts = {"episodes": 0, "lost_episodes": 0, "worker_restarts": 0, "hung_workers": 0}
        self.cores_per_worker = cores_per_worker
        self._busy_s = 0.0  # worker-seconds with at least one episode running, of the intervals that ended

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker (in parallel) and the watchdog; idempotent.

        Raises:
            the first error of a worker that could not start (every worker started is stopped again).
        """
        if self._started:
            return
        self._closing = False
        self._stop.clear()
        workers = start_workers(self.make_worker, self.workers, "agent-start")
        self._slots = [_Slot(worker=worker) for worker in workers]
        self._started = True
        self._watchdog = threading.Thread(target=self._watch, name="agent-pool-watchdog", daemon=True)
        self._watchdog.start()

    def shutdown(self) -> None:
        """Stop the watchdog and the workers (idempotent); episodes still running or waiting end as infrastructure
        failures."""
        if not self._started:
            return
        self._closing = True
        self._stop.set()
        with self._lock:
            lost = [r.future for slot in self._slots for r in slot.running.values()]
            lost += [future for _, future in self._waiting]
            workers = [slot.worker for slot in self._slots if slot.worker is not None]
            for slot in self._slots:
                slot.running, slot.worker = {}, None
                slot.generation += 1
                self._track(slot)
            self._waiting.clear()
            self._started = False
        for future in lost:
            _settle(future, infra_outcome("the agent pool shut down before the episode ended"))
        for worker in workers:
            worker.close()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)

    # ---- the protocol -----------------------------------------------------------------------------------------
    def submit(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Queue one episode and return at once (module docstring).

        Raises:
            RuntimeError: the pool is not started.
        """
        if not self._started:
            raise RuntimeError("agent pool: submit before start() (or after shutdown())")
        future: Future[AgentOutcome] = Future()
        with self._lock:
            self._waiting.append((ticket, future))
            self._dispatch()
        return future

    def describe(self) -> str:
        return (f"{self.workers} agent worker(s) ({self.kind}, {self.per_worker} episodes each at once, "
                f"{self.timeout_s:g} s per episode)")

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the workers (pool ``agents``, none before :meth:`start`) and the seconds
        each had at least one episode running, so far (an episode running now counts up to now)."""
        with self._lock:
            now = time.monotonic()
            busy = self._busy_s + sum(now - s.busy_since for s in self._slots if s.busy_since is not None)
            serving = self.workers if self._started else 0
        return [PoolTime("agents", serving, busy, cores=serving * self.cores_per_worker)]

    def metrics(self) -> dict[str, float]:
        """``agent_pool/workers`` and the cumulative ``agent_pool/{episodes, lost_episodes, worker_restarts,
        hung_workers}`` (lost: episodes whose worker died or hung)."""
        return {"agent_pool/workers": float(self.workers),
                **{f"agent_pool/{k}": float(v) for k, v in self.counts.items()}}

    # ---- dispatch and results ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send waiting episodes to the least busy workers with a free slot (caller holds the lock)."""
        while self._waiting:
            free = [(len(s.running), i) for i, s in enumerate(self._slots)
                    if s.worker is not None and len(s.running) < self.per_worker]
            if not free:
                return
            _, index = min(free)
            slot = self._slots[index]
            ticket, future = self._waiting.popleft()
            rid = next(self._ids)
            slot.running[rid] = _Running(ticket, future, time.monotonic() + self.timeout_s + self.grace_s)
            self._track(slot)
            try:
                inner = slot.worker.run(ticket)
            except Exception as exc:  # noqa: BLE001 - a worker that cannot be reached is lost
                self._lose_later(index, slot.generation, f"could not be reached ({type(exc).__name__}: {exc})")
                return  # its replacement dispatches again
            inner.add_done_callback(partial(self._finished, index, slot.generation, rid))

    def _finished(self, index: int, generation: int, rid: int, inner: Future) -> None:
        """A worker's episode ended (any thread): its outcome, or the worker's loss."""
        error = inner.exception()
        if error is not None:
            self._lose_later(index, generation, f"died ({type(error).__name__}: {error})")
            return
        with self._lock:
            slot = self._slots[index] if index < len(self._slots) else None
            if slot is None or slot.generation != generation or rid not in slot.running:
                return
            running = slot.running.pop(rid)
            self._track(slot)
            self.counts["episodes"] += 1
            self._dispatch()
        _settle(running.future, inner.result())

    def _track(self, slot: _Slot) -> None:
        """After ``slot.running`` changed (caller holds the lock): open or close its busy interval."""
        if slot.running and slot.busy_since is None:
            slot.busy_since = time.monotonic()
        elif not slot.running and slot.busy_since is not None:
            self._busy_s += time.monotonic() - slot.busy_since
            slot.busy_since = None

    def _watch(self) -> None:
        """Every half second: a worker with an episode past its deadline is hung (module docstring)."""
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                hung = [(i, s.generation) for i, s in enumerate(self._slots)
                        if s.worker is not None and any(r.deadline < now for r in s.running.values())]
            for index, generation in hung:
                self._lose(index, generation, (
                    f"did not finish an episode within rollout.agent_pool.timeout_s + {self.grace_s:g} s = "
                    f"{self.timeout_s + self.grace_s:g} s: its event loop is blocked (a synchronous call in the "
                    f"agent?) or it hangs"), hung=True)

    # ---- losing and replacing a worker --------------------------------------------------------------------------
    def _lose_later(self, index: int, generation: int, reason: str) -> None:
        """:meth:`_lose` in a thread of its own (callers may hold the lock or run on a worker's reader thread)."""
        threading.Thread(target=self._lose, args=(index, generation, reason), name=f"agent-lose-{index}",
                         daemon=True).start()

    def _lose(self, index: int, generation: int, reason: str, hung: bool = False) -> None:
        """Fail every episode of slot ``index``'s worker (unless it was already replaced), kill it and start its
        replacement."""
        with self._lock:
            slot = self._slots[index] if index < len(self._slots) else None
            if slot is None or slot.generation != generation or slot.worker is None:
                return
            lost, worker = list(slot.running.values()), slot.worker
            slot.running, slot.worker = {}, None
            slot.generation += 1
            self._track(slot)
            self.counts["lost_episodes"] += len(lost)
            self.counts["hung_workers"] += int(hung)
        for running in lost:  # first what the caller waits on: nothing below may keep these futures open
            _settle(running.future, infra_outcome(f"its agent worker {reason}"))
        if not self._closing:
            _log_warning("agent pool: worker %d %s; its %d running episode(s) end as infrastructure failures, the "
                         "worker is replaced", index, reason, len(lost))
        worker.close()
        self._restart(index)

    def _restart(self, index: int) -> None:
        """Start a new worker in slot ``index``, trying again every few seconds until it starts or the pool
        closes."""
        delay = 1.0
        while not self._closing:
            try:
                worker = self.make_worker(index)
            except Exception as exc:  # noqa: BLE001 - tried again: episodes wait for a free slot meanwhile
                _log_warning("agent pool: worker %d could not be replaced (%s: %s); trying again in %g s", index,
                               type(exc).__name__, exc, delay)
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, 30.0)
                continue
            with self._lock:
                if self._closing or index >= len(self._slots):
                    worker.close()
                    return
                self._slots[index].worker = worker
                self.counts["worker_restarts"] += 1
                self._dispatch()
            return


def _log_warning(message: str, *args) -> None:
    """``logger.warning`` that cannot stop the pool's threads: a handler that raises (a user's, or a log file whose
    folder is gone) makes the record a line on stderr instead."""
    try:
        logger.warning(message, *args)
    except Exception as exc:  # noqa: BLE001 - the pool's work comes first
        print(f"agent pool: {message % args} (the log handler failed: {type(exc).__name__}: {exc})", file=sys.stderr)


def _settle(future: Future, outcome: AgentOutcome) -> None:
    """Resolve ``future`` with ``outcome`` unless it is resolved already."""
    try:
        future.set_result(outcome)
    except Exception:  # noqa: BLE001 - InvalidStateError: already resolved (a late duplicate)
        pass
