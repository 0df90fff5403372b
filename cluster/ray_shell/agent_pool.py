"""The agent pool on Ray: ``rollout.agent_pool.workers`` agent worker actors (``num_cpus_per_worker`` CPUs and
``resources`` each), each running up to ``episodes_per_worker`` episodes at once, fed and watched by
:class:`cluster.agents.pool.AgentWorkerPool`.

    pool = ray_agent_pool(spec)     # None without an agent (rollout.agent, multi_turn.runner agent_pool)
    pool.start()                    # once Ray runs (GRPOJob.start does it)

Each actor (:class:`AgentActor`, a plain class) builds an :class:`cluster.agents.worker.AgentWorkerCore` from the
job's :class:`cluster.agents.plan.AgentPlan` when it starts: the agent is imported again from the spec file's folder
(a Ray job's working dir: ``grpo-cluster submit`` ships the agent file with the spec). The actor is an async actor:
each ``run`` call awaits one episode on the core's event loop, so its episodes run concurrently. An actor that dies
(its process killed, its node lost) loses its running episodes; one that stays silent past the episode timeout is
killed; either way the episodes are infrastructure failures and a new actor takes the slot.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future

import ray

from cluster.agents.loading import AgentLoadError
from cluster.agents.plan import AgentPlan, agent_kind_name, build_plan
from cluster.agents.pool import AgentWorkerLost, AgentWorkerPool
from cluster.ray_shell.pools import WorkerTimeout, get
from contract.agents import AgentOutcome, EpisodeTicket

__all__ = ["AgentActor", "RayAgentWorker", "ray_agent_pool"]


class AgentActor:
    """The agent worker actor's class: an ``AgentWorkerCore``, or why it could not be built (so an agent that does
    not import is reported with its own message, naming its file and line, not as a dead actor)."""

    def __init__(self, plan: AgentPlan):
        from cluster.agents.worker import AgentWorkerCore

        try:
            self.core, self.error = AgentWorkerCore(plan), None
        except AgentLoadError as exc:
            self.core, self.error = None, str(exc)

    def ready(self) -> int | str:
        """The actor's pid, or the message of the error that stopped it loading the agent."""
        return self.error if self.error is not None else os.getpid()

    async def run(self, ticket: EpisodeTicket) -> AgentOutcome:
        """One episode on the core's event loop (``AgentWorkerCore.submit``)."""
        return await asyncio.wrap_future(self.core.submit(ticket))


class RayAgentWorker:
    """One agent worker actor (``cluster.agents.pool.AgentWorker``), started and ready.

    Args:
        plan: the agent plan. spec: the job spec (``rollout.agent_pool``). index: its slot.

    Raises:
        AgentLoadError: the agent did not load in the actor. AgentWorkerLost: the actor died or was not ready within
            ``rollout.agent_pool.start_timeout_s`` (e.g. no node has the CPUs it reserves).
    """

    def __init__(self, plan: AgentPlan, spec, index: int):
        ap = spec.rollout.agent_pool
        self.actor = ray.remote(AgentActor).options(
            num_cpus=ap.num_cpus_per_worker, resources=dict(ap.resources), max_restarts=0,
            max_concurrency=ap.episodes_per_worker + 2).remote(plan)
        what = f"agent worker {index} ({ap.num_cpus_per_worker:g} CPU, resources {dict(ap.resources)})"
        try:
            ready = get(self.actor.ready.remote(), ap.start_timeout_s, f"starting {what}")
        except WorkerTimeout as exc:
            self.close()
            raise AgentWorkerLost(f"{exc} (rollout.agent_pool.start_timeout_s)") from None
        except ray.exceptions.RayError as exc:
            self.close()
            raise AgentWorkerLost(f"{what} died while starting: {type(exc).__name__}") from None
        if isinstance(ready, str):
            self.close()
            raise AgentLoadError(ready)
        self.pid = ready

    def run(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Start one episode on the actor (``cluster.agents.pool.AgentWorker.run``)."""
        out: Future[AgentOutcome] = Future()

        def done(inner: Future) -> None:
            error = inner.exception()
            if error is None:
                out.set_result(inner.result())
            else:
                out.set_exception(AgentWorkerLost(f"agent worker actor (pid {self.pid}) died: "
                                                  f"{type(error).__name__}"))

        self.actor.run.remote(ticket).future().add_done_callback(done)
        return out

    def close(self) -> None:
        """Kill the actor (idempotent)."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass


def ray_agent_pool(spec, imports: tuple[str, ...] = ()) -> AgentWorkerPool | None:
    """The job's agent pool on Ray (module docstring): None when the job runs no agent kind; ``imports``: modules the
    actors import first (``--import``). Nothing touches Ray until the pool starts."""
    if agent_kind_name(spec.rollout) is None:
        return None
    plan, ap = build_plan(spec, imports), spec.rollout.agent_pool
    return AgentWorkerPool(lambda index: RayAgentWorker(plan, spec, index), ap.workers, ap.episodes_per_worker,
                           ap.timeout_s, "Ray actors", cores_per_worker=ap.num_cpus_per_worker)
