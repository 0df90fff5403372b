"""Running a real :class:`cluster.driver.GRPOJob` in a test: whatever happens, stop what the job started (its engines,
train ranks and placement groups, so the module's next job finds the Ray cluster free) and its metrics endpoint."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import pytest

#: Figures of the wall clock or the machine's memory, not of the run: a resumed run's differ from an uninterrupted
#: one's. The stall detector's value and flag (``health/value/stall``, ``health/stall``) are ratios of step times.
WALL_CLOCK = re.compile(r"^(timing|time|perf|memory|goodput)/|seconds|_s$|_per_s$|idle_fraction$|peak|"
                        r"^health/(value/)?stall$")


def assert_same_metrics(got: list[dict], ref: list[dict]) -> None:
    """A resumed run's ``metrics.jsonl`` rows equal the uninterrupted run's, step by step: every key but the
    wall-clock ones (:data:`WALL_CLOCK`); counts, versions, flags and texts exactly, real numbers within float noise
    (relative 1e-5, absolute 1e-6, as ``tests/ray/test_reliability.py`` compares). The engine's logprobs can differ
    from run to run in their last bits (vLLM on CPU schedules a batch by how loaded the machine is), which moves
    figures such as ``rollout/logprob_diff`` (a gap of about 4e-7) by 1e-8; a resume that trained or sampled
    differently moves them by far more."""
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in (k for k in r if not WALL_CLOCK.search(k)):
            value, expected = g.get(key), r[key]
            if isinstance(expected, float) and isinstance(value, float):
                assert value == pytest.approx(expected, rel=1e-5, abs=1e-6, nan_ok=True), \
                    f"step {g['step']} {key}: {value!r} != {expected!r}"
            else:
                assert value == expected, f"step {g['step']} {key}: {value!r} != {expected!r}"


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
