"""Running a real :class:`cluster.driver.GRPOJob` in a test: whatever happens, stop what the job started (its engines,
train ranks and placement groups, so the module's next job finds the Ray cluster free) and its metrics endpoint."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

#: Figures of the wall clock or the machine's memory, not of the run: a resumed run's differ from an uninterrupted
#: one's. The stall detector's value and flag (``health/value/stall``, ``health/stall``) are ratios of step times.
WALL_CLOCK = re.compile(r"^(timing|time|perf|memory|goodput)/|seconds|_s$|_per_s$|idle_fraction$|peak|"
                        r"^health/(value/)?stall$")


@contextmanager
def stopped_after(job) -> Iterator:
    """Yield ``job``; on leaving the block (an exception included) call ``job.close()`` and ``job.shutdown()``.

    Example: ``with stopped_after(GRPOJob(spec, progress=False)) as job: history = job.run()``.
    """
    try:
        yield job
    finally:
        job.close()
        job.shutdown()


def run_to_end(job) -> list[dict]:
    """``job.run()`` to ``total_steps`` inside :func:`stopped_after`; returns the per-step metrics it returned."""
    with stopped_after(job):
        return job.run()
