"""What a pool tells the goodput ledger about its time (``cluster.loop.goodput``): a pool is any set of workers the job
waits on — rollout engines, train ranks, reward workers, environment workers, agents. No project imports: every
role may implement it.

A pool takes part by implementing :class:`TimedPool` (one method, :meth:`TimedPool.pool_times`): the ledger asks
every collaborator of the job that has it at each step's start and end and takes the difference, so the loop never
names a pool and a new pool costs its own counters only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["PoolTime", "TimedPool"]


@dataclass(frozen=True)
class PoolTime:
    """One pool's time figures, cumulative since the object that reports them was built (they never go down).

    Attributes:
        pool: the pool's name in the metric keys (``time/<pool>_busy_s``): lower-case letters and digits only
            (``rollout``, ``train``, ``reward``, ``environment``).
        workers: workers serving now (engines, ranks, reward workers, environment slots), >= 0.
        busy_s: worker-seconds spent doing the pool's own work so far (an engine sampling, a rank in its train step,
            a reward worker scoring a call, an environment stepping), each worker's seconds summed.
        waiting_s: worker-seconds spent blocked on another pool so far, as far as the pool can tell (0 when it cannot).
        cores: CPU cores allotted to the pool now (its workers' Ray resources, e.g. ``rollout.replicas`` x
            ``rollout.num_cpus_per_replica``); 0 when it runs on the driver's cores.
    """

    pool: str
    workers: int
    busy_s: float
    waiting_s: float = 0.0
    cores: float = 0.0


@runtime_checkable
class TimedPool(Protocol):
    """A collaborator whose workers' time the goodput ledger reads."""

    def pool_times(self) -> list[PoolTime]:
        """Each pool this object runs, its cumulative figures now (cheap: called twice a step, from the driver)."""
        ...
