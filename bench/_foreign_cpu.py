"""CPU used on the machine by processes that are not the benchmark's own while a measured run goes on: on the shared
2-core machine other developers' commands (a ``pytest -n 2``, a ``grpo-cluster validate``) run outside the heavy-job
lock at nice 0, while Ray runs its workers (the engine, the train ranks) at nice 15, so even a short foreign command
takes nearly a whole core from the job for as long as it runs. A benchmark records this figure beside each run so that
a run slowed by a neighbour can be told from one slowed by what it measures.

    with ForeignCpu(interval_s=5.0) as foreign:
        run_the_job()
    foreign.result()   # {"foreign_cpu_s", "own_cpu_s", "machine_busy_cpu_s", "wall_s", "top"}

A process is the benchmark's own when it is this process or one of its descendants (the job's driver, Ray's raylet and
GCS, the actors and their children) when a sample sees it. Each process's CPU seconds count from the start of the
window (from zero for one started inside it) to the last sample that saw it; so a process that lives less than one
interval may be missed, and the CPU a process uses after the last sample that saw it is not counted:
``foreign_cpu_s`` is a lower bound. ``machine_busy_cpu_s`` (from ``/proc/stat``) counts everything.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

__all__ = ["ForeignCpu"]

_Key = tuple[int, float]  # (pid, create time): a pid may be reused within a run


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


class ForeignCpu:
    """A sampler thread, from ``__enter__`` to ``__exit__`` (module docstring).

    Args:
        interval_s: seconds between samples (each costs a few tens of milliseconds of one core for ~200 processes).
        top: how many of the busiest foreign processes :meth:`result` names.
    """

    def __init__(self, interval_s: float = 5.0, top: int = 3):
        self.interval_s, self.top = interval_s, top
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[_Key, float] = {}
        self._last: dict[_Key, float] = {}
        self._names: dict[_Key, str] = {}
        self._own: set[_Key] = set()
        self._t0 = self._t1 = self._busy0 = self._busy1 = 0.0

    def __enter__(self) -> ForeignCpu:
        self._t0, self._busy0 = time.monotonic(), _busy_s()
        self._start_wall = time.time()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self._t1, self._busy1 = time.monotonic(), _busy_s()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        me = psutil.Process(os.getpid())
        try:
            own = {me.pid, *(c.pid for c in me.children(recursive=True))}
        except psutil.Error:
            own = {me.pid}
        for p in psutil.process_iter(["pid", "create_time", "cpu_times", "name", "cmdline"]):
            info = p.info
            if info["cpu_times"] is None or info["create_time"] is None:
                continue
            key = (info["pid"], info["create_time"])
            cpu = info["cpu_times"].user + info["cpu_times"].system
            if key not in self._first:
                self._first[key] = cpu if info["create_time"] < self._start_wall else 0.0
            if info["cmdline"] or key not in self._names:  # the command after an exec; a zombie's is empty
                self._names[key] = " ".join(" ".join(info["cmdline"] or [info["name"] or "?"]).split())[:80]
            self._last[key] = cpu
            if info["pid"] in own:
                self._own.add(key)

    def result(self) -> dict:
        """After the window: ``foreign_cpu_s`` and ``own_cpu_s`` (CPU seconds of the other processes and of the
        benchmark's own, lower bounds), ``machine_busy_cpu_s`` (all CPU seconds the machine spent, ``/proc/stat``),
        ``wall_s``, and ``top``: the busiest foreign processes as ``[command, CPU seconds]``."""
        used = {k: self._last[k] - self._first[k] for k in self._last}
        foreign = sorted(((self._names[k], s) for k, s in used.items() if k not in self._own and s > 0),
                         key=lambda x: -x[1])
        return {"foreign_cpu_s": sum(s for _, s in foreign),
                "own_cpu_s": sum(s for k, s in used.items() if k in self._own),
                "machine_busy_cpu_s": self._busy1 - self._busy0, "wall_s": self._t1 - self._t0,
                "top": [[name, round(s, 1)] for name, s in foreign[:self.top]]}
