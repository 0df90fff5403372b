"""``cluster.worker_start.start_workers``: every worker at once, all or none."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.worker_start import start_workers


class _Worker:
    def __init__(self, index: int, closed: list[int]):
        self.index = index
        self.closed = closed

    def close(self) -> None:
        self.closed.append(self.index)


def test_start_workers_makes_them_at_once_in_order():
    closed: list[int] = []
    names: list[str] = []

    def make(i: int) -> _Worker:
        names.append(threading.current_thread().name)
        time.sleep(0.3)
        return _Worker(i, closed)

    t0 = time.monotonic()
    workers = start_workers(make, 4, "test-start")
    assert [w.index for w in workers] == [0, 1, 2, 3] and closed == []
    assert time.monotonic() - t0 < 1.0  # not 4 x 0.3 s one after another
    assert all(name.startswith("test-start") for name in names)


def test_start_workers_closes_the_started_ones_and_raises_the_error():
    closed: list[int] = []

    def make(i: int) -> _Worker:
        if i == 2:
            raise ValueError("worker 2 cannot start")
        return _Worker(i, closed)

    with pytest.raises(ValueError, match="worker 2 cannot start"):
        start_workers(make, 4, "test-start")
    assert sorted(closed) == [0, 1, 3]
