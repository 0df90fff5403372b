"""Starting a pool's workers: every worker at once, each in a thread of its own, all or none (the reward pool,
``cluster.rewards.pool``, and the agent pool, ``cluster.agents.pool``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

__all__ = ["start_workers"]


class _Closable(Protocol):
    def close(self) -> None: ...


W = TypeVar("W", bound=_Closable)


def start_workers(make_worker: Callable[[int], W], count: int, name: str) -> list[W]:
    """``[make_worker(0), ..., make_worker(count - 1)]``, made at once in threads named ``<name>_<i>`` (a worker's
    start-up waits on its process or actor: the pool starts in the time of its slowest worker, not their sum).

    Raises:
        the first error of a worker that could not start (an ``AgentLoadError``, a Ray error), after every worker
        that did start was closed.
    """
    with ThreadPoolExecutor(max_workers=max(count, 1), thread_name_prefix=name) as starters:
        futures = [starters.submit(make_worker, i) for i in range(count)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for future in futures:
            if future.exception() is None and future.result() is not None:
                future.result().close()
        raise errors[0]
    return [future.result() for future in futures]
