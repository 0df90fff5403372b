"""CPU seconds that processes and threads use over a window (psutil), for tests that bound what an idle part costs:
an idle reward pool must not poll (its worker processes or actors and the driver's pool threads sleep until a chunk
arrives), or it takes cores from the engine and the train ranks on a small machine.

CPU time, not wall time, is measured, so the bounds hold on a loaded machine too."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import psutil

__all__ = ["cpu_used"]


def _process_cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _threads_cpu_s(native_ids: set[int]) -> float:
    return sum(t.user_time + t.system_time for t in psutil.Process(os.getpid()).threads() if t.id in native_ids)


def cpu_used(pids: Sequence[int], native_ids: Sequence[int], seconds: float) -> tuple[dict[int, float], float]:
    """CPU seconds (user + system) used over the next ``seconds`` wall seconds by each process of ``pids`` and,
    together, by the threads of this process whose ``threading.Thread.native_id`` is in ``native_ids``.

    Returns:
        ({pid: CPU seconds}, CPU seconds of the threads).

    Raises:
        psutil.NoSuchProcess: a process of ``pids`` ended during the window.
    """
    ids = set(native_ids)
    before = {pid: _process_cpu_s(pid) for pid in pids}
    threads_before = _threads_cpu_s(ids)
    time.sleep(seconds)
    return ({pid: _process_cpu_s(pid) - before[pid] for pid in pids}, _threads_cpu_s(ids) - threads_before)
