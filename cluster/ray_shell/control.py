"""Control channel of a running job: a named Ray actor through which ``grpo-cluster scale`` asks the driver to
resize the rollout pool, and the driver publishes where it is.

    # in the driver (cluster/driver.py), once the pools exist:
    control = start_control(current_job_id(spec.name), spec.rollout.replicas)
    ...  # between steps:
    n = control.desired_rollout_replicas()         # the driver resizes the pool when n != engines
    control.report({"step": s, "policy_version": v, "rollout_replicas": n_engines})
    control.close()                                # at the end

    # on the cluster (what `grpo-cluster scale` submits as a tiny Ray job; see cluster/ops/jobs.py):
    python -m cluster.ray_shell.control set JOB_ID N         # prints "GRPO_CONTROL_RESULT {json}", exit 0
    python -m cluster.ray_shell.control get JOB_ID           # same line, without changing anything

The actor is ``JobControl`` named ``grpo-cluster-control:<job id>`` in the Ray namespace ``grpo-cluster``; it is
owned by the driver and dies with it (not detached), so a finished job has no control actor. The job id is the Ray
Jobs submission id when the driver runs under ``grpo-cluster submit`` (``GRPO_CLUSTER_JOB_ID``, which submit sets, or
the ``job_submission_id`` Ray puts in the entrypoint's ``RAY_JOB_CONFIG_JSON_ENV_VAR``), otherwise the spec name.

This module imports only the standard library and Ray: ``grpo-cluster scale`` ships it alone as the working dir of
its tiny control job, so it also works on a cluster where the project is not installed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

__all__ = [
    "ACTOR_PREFIX", "ERROR_MARKER", "JOB_ID_ENV", "MAX_ROLLOUT_REPLICAS", "NAMESPACE", "RESULT_MARKER", "ControlError",
    "ControlHandle", "JobControlState", "actor_name", "check_replicas", "current_job_id", "start_control",
]

logger = logging.getLogger(__name__)

NAMESPACE = "grpo-cluster"
"""Ray namespace of every job's control actor."""
ACTOR_PREFIX = "grpo-cluster-control:"
"""Control actor name = ACTOR_PREFIX + job id."""
JOB_ID_ENV = "GRPO_CLUSTER_JOB_ID"
"""Environment variable ``grpo-cluster submit`` sets (runtime env) to the job's submission id."""
MAX_ROLLOUT_REPLICAS = 4096
"""Upper bound of a scale request; the same bound as ``rollout.replicas`` in the spec (cluster/spec/)."""
RESULT_MARKER = "GRPO_CONTROL_RESULT"
ERROR_MARKER = "GRPO_CONTROL_ERROR"


class ControlError(RuntimeError):
    """The control actor cannot be created or reached (name taken, no such job)."""


def actor_name(job_id: str) -> str:
    return ACTOR_PREFIX + job_id


def current_job_id(default: str) -> str:
    """The id ``grpo-cluster scale`` addresses this driver by: ``$GRPO_CLUSTER_JOB_ID``, else the Ray Jobs
    submission id of the entrypoint this process runs in, else ``default`` (the spec name, for ``run``)."""
    if os.environ.get(JOB_ID_ENV):
        return os.environ[JOB_ID_ENV]
    config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if config:
        try:
            submission_id = (json.loads(config).get("metadata") or {}).get("job_submission_id")
        except (ValueError, AttributeError):
            submission_id = None
        if submission_id:
            return str(submission_id)
    return default


def check_replicas(n: Any, bound: int = MAX_ROLLOUT_REPLICAS) -> int:
    """``n`` as an int in [1, bound]; raises ValueError naming the expected range otherwise (bools rejected)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"rollout replicas: expected an integer in [1, {bound}], got {n!r}")
    if not 1 <= n <= bound:
        raise ValueError(f"rollout replicas: expected an integer in [1, {bound}], got {n}")
    return n


class JobControlState:
    """What the control actor holds: the desired rollout replicas (set by ``scale``) and the driver's last report.

    Args:
        job_id: the id the job is addressed by.
        rollout_replicas: the pool size the job started with (the initial desired value).

    Report keys ``scale`` shows: ``step``, ``policy_version``, ``rollout_replicas`` (engines serving now). The driver
    may add ``max_rollout_replicas``; scale requests above it are then rejected (otherwise the bound is
    MAX_ROLLOUT_REPLICAS).
    """

    def __init__(self, job_id: str, rollout_replicas: int):
        self.job_id = job_id
        self.desired = check_replicas(rollout_replicas)
        self.status: dict = {}
        self.reported_at: float | None = None  # time.time() of the last report
        self.requests: list[tuple[float, int]] = []  # (time.time(), n) of every accepted scale request

    def desired_rollout_replicas(self) -> int:
        return self.desired

    def set_desired_rollout_replicas(self, n: int) -> dict:
        """Record a scale request; returns :meth:`summary` with ``previous_desired``. Raises ValueError when ``n`` is
        outside [1, bound] (bound: the driver's ``max_rollout_replicas`` if it reported one)."""
        bound = int(self.status.get("max_rollout_replicas", MAX_ROLLOUT_REPLICAS))
        check_replicas(n, bound)
        previous, self.desired = self.desired, n
        self.requests.append((time.time(), n))
        return {**self.summary(), "previous_desired": previous}

    def report(self, status: dict) -> None:
        """Replace the published status (step, policy_version, rollout_replicas, ...) with ``status``."""
        self.status = dict(status)
        self.reported_at = time.time()

    def summary(self) -> dict:
        """``{"job_id", "desired_rollout_replicas", "status", "reported_s_ago"}``, JSON-serialisable."""
        ago = None if self.reported_at is None else round(time.time() - self.reported_at, 1)
        return {"job_id": self.job_id, "desired_rollout_replicas": self.desired, "status": self.status,
                "reported_s_ago": ago}


class ControlHandle:
    """The driver's side of the control channel (returned by :func:`start_control`).

    Args:
        actor: the JobControl actor handle.
        job_id: the id it is named by.
        rollout_replicas: the starting pool size (answered while the actor cannot be reached).
        timeout_s: how long :meth:`desired_rollout_replicas` waits for the actor, seconds.
    """

    def __init__(self, actor, job_id: str, rollout_replicas: int, timeout_s: float = 2.0):
        self.actor = actor
        self.job_id = job_id
        self.name = actor_name(job_id)
        self.timeout_s = timeout_s
        self._last = rollout_replicas

    def desired_rollout_replicas(self) -> int:
        """The pool size ``scale`` last asked for; the previous answer if the actor does not reply in timeout_s."""
        import ray

        try:
            self._last = int(ray.get(self.actor.desired_rollout_replicas.remote(), timeout=self.timeout_s))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            logger.warning("control actor %s did not answer (%s); keeping %d rollout replicas",
                           self.name, type(exc).__name__, self._last)
        return self._last

    def report(self, status: dict) -> None:
        """Publish the driver's status (fire and forget). Values must be JSON-serialisable (numbers, strings,
        lists, dicts); others are sent as their ``str``."""
        self.actor.report.remote(json.loads(json.dumps(status, default=str)))

    def close(self) -> None:
        """Remove the actor (``scale`` then reports that the job has no control channel)."""
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # already gone with its node, or Ray shut down: nothing left to release
            logger.debug("control actor %s: kill failed: %s", self.name, exc)


def start_control(job_id: str, rollout_replicas: int) -> ControlHandle:
    """Create the job's control actor (``ray.init`` must have been called) on the driver's own Ray node, so that
    losing a worker node never takes the ``scale`` channel with it, and return the driver's handle.

    Raises ControlError when a live actor already has the name: another driver with the same job id (for ``run``,
    the same spec name) is running on this cluster.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(JobControlState)
    name = actor_name(job_id)
    driver_node = ray.get_runtime_context().get_node_id()  # lives and dies with the driver, not with a worker node
    try:
        actor = actor_cls.options(name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=0,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=False),
                                  ).remote(job_id, rollout_replicas)
    except ValueError as exc:  # Ray: "The name ... is already taken"
        raise ControlError(f"a job control actor {name!r} already exists in namespace {NAMESPACE!r}: another "
                           f"driver with job id {job_id!r} is running on this cluster; give the job another name "
                           f"({exc})") from None
    handle = ControlHandle(actor, job_id, rollout_replicas)
    ray.get(actor.desired_rollout_replicas.remote(), timeout=60)  # surfaces creation errors now
    return handle


# ------------------------------------------------------------------------------- entrypoint of the control job
def _lookup(job_id: str):
    import ray

    try:
        return ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        raise ControlError(
            f"no running grpo-cluster job {job_id!r} on this cluster (no actor {actor_name(job_id)!r} in namespace "
            f"{NAMESPACE!r}): the job has finished, its driver has not started yet, or {job_id!r} is not the id it "
            f"runs under (the submission id, or the spec name for `grpo-cluster run`)") from None


def _main(argv: list[str]) -> int:
    """``set JOB N`` / ``get JOB``: connect to the cluster (address auto), talk to the actor, print one marker line
    (``GRPO_CONTROL_RESULT {json}`` or ``GRPO_CONTROL_ERROR message``). Exit 0 on success, 2 on any error."""
    usage = "usage: python -m cluster.ray_shell.control set JOB_ID N | get JOB_ID"
    if not argv or argv[0] not in ("set", "get") or len(argv) != (3 if argv[0] == "set" else 2):
        print(f"{ERROR_MARKER} {usage}", flush=True)
        return 2
    import ray

    try:
        n = None
        if argv[0] == "set":
            try:
                n = int(argv[2])
            except ValueError:
                n = argv[2]  # check_replicas names it
            n = check_replicas(n)
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        actor = _lookup(argv[1])
        call = actor.summary.remote() if n is None else actor.set_desired_rollout_replicas.remote(n)
        result = ray.get(call, timeout=30)
    except ray.exceptions.RayTaskError as exc:
        print(f"{ERROR_MARKER} {exc.cause if exc.cause is not None else exc}", flush=True)
        return 2
    except (ControlError, ValueError, ConnectionError, ray.exceptions.RayError) as exc:
        print(f"{ERROR_MARKER} {exc}", flush=True)
        return 2
    print(f"{RESULT_MARKER} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
