"""One function that builds a ready job on a Ray cluster from a spec: :func:`build_job` gives the pure loop
(:class:`cluster.driver.GRPOJob`) its Ray collaborators — rollout engine actors (:class:`EngineFleet`), the train pool
(:class:`RayTrainer`), the reward pool (reward worker actors, or the driver itself: ``ray_reward_pool``) and the job
control actor (:class:`RayControl`). ``grpo-cluster run``, submitted jobs and the
restart-on-failure loop (:mod:`cluster.ray_shell.restarts`) call it.

    import ray
    from cluster.ray_shell import build_job
    ray.init(num_cpus=2)
    job = build_job(load_spec("examples/learn_cpu.yaml"))
    history = job.run()
    job.close(); job.shutdown()

Nothing touches Ray until the job starts (the collaborators are built unstarted and the control actor is created on
first use), so a job can be built, and its inputs checked, before Ray is started or joined.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.driver import GRPOJob
from cluster.endpoint.job import job_endpoint
from cluster.ray_shell.agent_pool import ray_agent_pool
from cluster.ray_shell.control import ControlHandle, current_job_id, start_control
from cluster.ray_shell.fleet import EngineFleet
from cluster.ray_shell.reward_pool import ray_reward_pool
from cluster.ray_shell.train_pool import RayTrainer

__all__ = ["RayControl", "build_job"]


class RayControl:
    """The job's control channel (``contract.protocols.ControlChannel``) over the named control actor
    (:mod:`cluster.ray_shell.control`), created on first use once Ray runs, so ``grpo-cluster scale``/``status`` can
    reach the job while it runs.

    Args:
        job_id: the id the actor is named by (the submission id, or the spec's name for ``run``).
        rollout_replicas: the starting engine count.

    Raises:
        ControlError: (on first use) another driver with the same job id runs on this cluster.
    """

    def __init__(self, job_id: str, rollout_replicas: int):
        self.job_id, self.rollout_replicas = job_id, rollout_replicas
        self._handle: ControlHandle | None = None

    def _actor(self) -> ControlHandle:
        if self._handle is None:
            self._handle = start_control(self.job_id, self.rollout_replicas)
        return self._handle

    def desired_rollout_replicas(self) -> int | None:
        return self._actor().desired_rollout_replicas()

    def report(self, status: Mapping[str, Any]) -> None:
        self._actor().report(dict(status))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def build_job(spec, *, progress: bool = True, resume: bool = False, resume_past_trip: bool = False,
              dry_run: bool = False, control: bool = True, imports: tuple[str, ...] = ()) -> GRPOJob:
    """A job over Ray collaborators: :class:`EngineFleet` (``rollout.replicas`` engines of ``rollout.engine``),
    :class:`RayTrainer` (``train.world_size`` ranks of ``train.strategy``), the reward pool (``reward_pool.workers``
    reward worker actors; none: the driver scores), the agent pool (``rollout.agent_pool.workers`` agent worker
    actors, with an agent) and the agent endpoint they call (served in this process: ``cluster.endpoint.job``), the
    spec's metric sinks and (with ``control``) the control actor. Their pre-start checks run now; Ray is needed only
    from :meth:`GRPOJob.start` (``run``) on. ``imports``: modules the
    train ranks and reward workers import before they build (``--import``: user-registered variants).

    Raises:
        SetupError, ModelError, DataError, MetricsError: the job's inputs (naming the spec field).
    """
    channel = RayControl(current_job_id(spec.name), spec.rollout.replicas) if control and not dry_run else None
    fleet = EngineFleet(spec)
    return GRPOJob(spec, fleet=fleet, trainer=RayTrainer(spec, imports),
                   reward_pool=ray_reward_pool(spec, imports), agent_pool=ray_agent_pool(spec, imports),
                   agent_endpoint=job_endpoint(spec, fleet), control=channel, progress=progress, resume=resume,
                   dry_run=dry_run, resume_past_trip=resume_past_trip)
