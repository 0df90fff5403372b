"""Restart on failure: run a job and, when a worker fails, resume it from its latest checkpoint, up to
``spec.restart_on_failure`` times. Each attempt's job is built by :func:`cluster.ray_shell.runtime.build_job`.
"""

from __future__ import annotations

import ray

from cluster.ray_shell.pools import EngineFailure, TrainWorkerFailure, WorkerTimeout
from cluster.ray_shell.runtime import build_job
from cluster.ray_shell.sync import SyncMemberError

#: Failures a restart from the latest checkpoint can get past (a worker, an engine, a timeout, a sync member).
RESTARTABLE = (TrainWorkerFailure, EngineFailure, WorkerTimeout, SyncMemberError, ray.exceptions.RayError)


def run_with_restarts(spec, progress: bool = True, resume: bool = False, first_job=None,
                      imports: tuple[str, ...] = ()):
    """Run a job; when a worker fails, resume from the latest checkpoint up to ``spec.restart_on_failure`` times.

    ``first_job`` is an already constructed (not started) job for the first attempt (the CLI builds one before Ray
    starts, so bad data or model paths fail early).

    Returns (the last job, every completed step's metrics in step order).

    Raises:
        TrainWorkerFailure | EngineFailure | WorkerTimeout | NumericsError: the failure, once restarts are used up
            (``NumericsError`` is never retried: the same data would give the same NaN).
    """
    history: dict[int, dict] = {}
    attempt = 0
    while True:
        job = first_job if attempt == 0 and first_job is not None else build_job(
            spec, progress=progress, resume=resume or attempt > 0, imports=imports)
        try:
            job.run()
            history.update(job.completed)
            return job, [history[k] for k in sorted(history)]
        except RESTARTABLE as exc:
            history.update(job.completed)
            if attempt >= spec.restart_on_failure:
                raise
            attempt += 1
            job.status(f"failure: {type(exc).__name__}: {exc}; restarting from the latest checkpoint "
                        f"({attempt}/{spec.restart_on_failure})")
        finally:
            job.close()
            job.shutdown()
