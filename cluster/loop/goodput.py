"""Goodput: where each step's wall time went, pool by pool, and the tokens trained per wall second and per core-second.

One step has wall time W (seconds from the step's start to its metrics row, the span ``timing/step_s`` measures). Each
pool p — the driver, the rollout engines (``rollout``), the train ranks (``train``), and where the job has them the
reward workers (``reward``), the environment workers (``environment``) or any other pool that reports its time
(``contract.goodput.TimedPool``) — has n_p workers during the step, so n_p · W worker-seconds, split in three:

- ``time/<p>_busy_s``: worker-seconds doing the pool's own work, measured by the pool and read from its cumulative
  counters at the step's start and end: engines sampling (each engine's ``GenerateStats.seconds``), train ranks in
  their train step (each rank's ``timing/train_compute_s``), reward workers scoring a call, environment slots running
  an environment call.
- ``time/<p>_waiting_s``: worker-seconds held by another pool: the engines and the train ranks during the weight sync
  (its wall seconds × workers: the transfer holds both sides), plus what a pool reports itself.
- ``time/<p>_idle_s`` = n_p · W − busy − waiting: nothing to do (an engine while the ranks train, a rank while the
  engines sample).

The driver is the loop's main thread, one worker: its waiting is measured (:class:`DriverClock`) — the seconds inside
calls that block on another pool (the engines' generate, less the reward functions the driver itself runs in the
fleet's callback; the train step; the weight sync; collecting reward scores; in one_step_off/async the wait for the
producer thread's generate call) —, its busy time is the rest of W (scoring, advantages, packing micro-batches,
records), and its idle time is 0: within a step the main thread always either works or waits.

It adds up: for every pool busy + waiting + idle = n_p · W. Busy and waiting are measured and idle is what remains, so
the sum is exact by construction; what a check can fail on is a measured part that does not fit: busy + waiting >
n_p · W (time counted twice, or work outside the step counted in it). Idle is therefore reported as measured, never
clipped at 0: ``tests/unit/test_goodput.py`` and the in-process and Ray runs check that every part is >= -2 % of
n_p · W and that n_p · W equals ``timing/step_s`` × n_p within 2 %.

Goodput: ``goodput/trained_tokens`` = the update's loss tokens (the response tokens that count in the loss; 0 when
the update was skipped for NaN/Inf), ``goodput/tokens_per_s`` = trained tokens / W, ``goodput/cores`` = CPU cores
allotted to the job (the pools' own: the spec's resources, e.g. rollout 1 + train 2 × 0.5 = 2 for the demo; 0 from
every pool — the in-process runtime, all in the driver's process — means the driver process's CPU affinity), and
``goodput/tokens_per_core_s`` = trained tokens / (W · cores).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

from contract.goodput import PoolTime, TimedPool

__all__ = ["DRIVER_POOL", "SYNC_POOLS", "DriverClock", "GoodputLedger", "PART_KEYS", "process_cores"]

#: The driver's pool name (``time/driver_*``).
DRIVER_POOL = "driver"
#: Pools the weight sync holds for its whole wall time (waiting, per worker): the engines and the train ranks.
SYNC_POOLS = ("rollout", "train")
#: The three parts of a pool's worker-seconds, in the order of their metric keys.
PART_KEYS = ("busy_s", "waiting_s", "idle_s")
_POOL_NAME = re.compile(r"[a-z0-9]+")


def process_cores() -> float:
    """CPU cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where that is missing)."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return float(os.cpu_count() or 1)


class DriverClock:
    """Seconds the loop's main thread waited on other pools during the running step.

    :meth:`begin_step` makes the calling thread the step's thread; :meth:`waiting` and :meth:`working` count only in
    that thread (the producer thread of one_step_off/async is not the driver's main thread: its calls are ignored).
    They nest: the innermost block decides, so a ``working`` block inside a ``waiting`` one (the driver scoring in
    the fleet's callback while it waits for the engines) pauses the wait.

    Attributes:
        waiting_s: seconds spent in ``waiting`` blocks (less the ``working`` blocks inside them) since
            :meth:`begin_step`.
    """

    def __init__(self):
        self.waiting_s = 0.0
        self._owner: int | None = None
        self._stack: list[bool] = []  # True: waiting, False: working; the top decides
        self._since = 0.0

    def begin_step(self) -> None:
        """A new step, run by the calling thread: the count starts at 0."""
        self._owner = threading.get_ident()
        self.waiting_s = 0.0
        self._stack = []

    def _enter(self, waiting: bool) -> None:
        self._switch()
        self._stack.append(waiting)

    def _exit(self) -> None:
        self._switch()
        if self._stack:
            self._stack.pop()

    def _switch(self) -> None:
        now = time.perf_counter()
        if self._stack and self._stack[-1]:
            self.waiting_s += now - self._since
        self._since = now

    def waiting(self) -> AbstractContextManager[None]:
        """The ``with`` body blocks on another pool (counted in the step's thread only)."""
        return self._within(waiting=True)

    def working(self) -> AbstractContextManager[None]:
        """The ``with`` body is the driver's own work, even inside a :meth:`waiting` block."""
        return self._within(waiting=False)

    @contextmanager
    def _within(self, waiting: bool) -> Iterator[None]:
        """The ``with`` body waits on another pool (``waiting``) or is the driver's own work; a thread other than
        the step's counts nothing."""
        if threading.get_ident() != self._owner:
            yield
            return
        self._enter(waiting)
        try:
            yield
        finally:
            self._exit()


class GoodputLedger:
    """Each step's ``time/<pool>_*`` and ``goodput/*`` figures (module docstring).

    Args:
        parts: → the job's collaborators now; those that are a :class:`contract.goodput.TimedPool` are read (the
            others are skipped: a part that runs nothing of its own, e.g. reward functions in the driver).
        fallback_cores: the cores when no pool reports any (default: this process's CPU affinity).

    Attributes:
        driver: the driver's :class:`DriverClock` (the loop's phases wrap their blocking calls in it).
        overhead_s: seconds the ledger itself took so far (reading the pools, computing the figures).
    """

    def __init__(self, parts: Callable[[], Iterable[object]], fallback_cores: Callable[[], float] = process_cores):
        self.driver = DriverClock()
        self._parts = parts
        self._fallback_cores = fallback_cores
        self._t0: float | None = None
        self._start: dict[str, PoolTime] = {}
        self.overhead_s = 0.0

    def read(self) -> dict[str, PoolTime]:
        """Every reporting pool's cumulative figures now, by name (two parts reporting one name are summed).

        Raises:
            ValueError: a pool name that is not lower-case letters and digits (it must fit a metric key).
        """
        pools: dict[str, PoolTime] = {}
        for part in self._parts():
            if not isinstance(part, TimedPool):
                continue
            for t in part.pool_times():
                if not _POOL_NAME.fullmatch(t.pool) or t.pool == DRIVER_POOL:
                    raise ValueError(f"{type(part).__name__}.pool_times: pool name {t.pool!r}: expected lower-case "
                                     f"letters and digits, not {DRIVER_POOL!r}")
                seen = pools.get(t.pool)
                pools[t.pool] = t if seen is None else PoolTime(
                    t.pool, seen.workers + t.workers, seen.busy_s + t.busy_s, seen.waiting_s + t.waiting_s,
                    seen.cores + t.cores)
        return pools

    def begin_step(self) -> None:
        """The step starts now (in the calling thread, the driver's)."""
        t = time.perf_counter()
        self._start = self.read()
        self.driver.begin_step()
        self._t0 = time.perf_counter()
        self.overhead_s += self._t0 - t

    def end_step(self, *, sync_s: float, trained_tokens: float) -> dict[str, float]:
        """The step's figures, its wall time ending now.

        Args:
            sync_s: wall seconds of the step's weight sync (``timing/sync_s``; 0 when nothing was sent).
            trained_tokens: the update's loss tokens (0 when it was skipped).

        Raises:
            RuntimeError: before :meth:`begin_step`.
        """
        if self._t0 is None:
            raise RuntimeError("GoodputLedger.end_step before begin_step")
        wall = time.perf_counter() - self._t0
        t = time.perf_counter()
        waited = min(self.driver.waiting_s, wall)
        out = _parts(DRIVER_POOL, 1, wall - waited, waited, wall)
        cores = 0.0
        for name, now in self.read().items():
            before = self._start.get(name, PoolTime(name, 0, 0.0, 0.0))
            held = sync_s * now.workers if name in SYNC_POOLS else 0.0
            out.update(_parts(name, now.workers, now.busy_s - before.busy_s,
                              now.waiting_s - before.waiting_s + held, wall))
            cores += now.cores
        cores = cores if cores > 0 else self._fallback_cores()
        out.update({"goodput/trained_tokens": float(trained_tokens), "goodput/cores": cores,
                    "goodput/tokens_per_s": trained_tokens / wall if wall > 0 else 0.0,
                    "goodput/tokens_per_core_s": trained_tokens / (wall * cores) if wall > 0 else 0.0})
        self.overhead_s += time.perf_counter() - t
        return out


def _parts(pool: str, workers: int, busy: float, waiting: float, wall: float) -> dict[str, float]:
    """``time/<pool>_{workers, busy_s, waiting_s, idle_s}``; idle is the rest of ``workers`` × ``wall``."""
    return {f"time/{pool}_workers": float(workers), f"time/{pool}_busy_s": busy,
            f"time/{pool}_waiting_s": waiting, f"time/{pool}_idle_s": workers * wall - busy - waiting}
