"""The reward pool on Ray: ``reward_pool.workers`` reward worker actors (``reward_pool.num_cpus_per_worker`` CPUs
and ``reward_pool.resources`` each), fed and watched by :class:`cluster.rewards.pool.WorkerPool`.

    pool = ray_reward_pool(spec)     # InlineRewardPool with workers 0 (the default), else a WorkerPool of actors
    pool.start()                     # once Ray runs (GRPOJob.start does it)

Each actor (:class:`RewardActor`, a plain class) loads the job's reward functions from a
:class:`cluster.rewards.worker.RewardPlan` when it starts: registered ones travel as the function objects (Ray's
cloudpickle), spec-named ones (``file.py:function``) are loaded again from the spec's folder. A call that runs past
``reward_pool.timeout_s`` kills the actor; an actor that dies (its process killed, its node lost) loses its call:
either way the call's completions get no reward and a new actor takes the slot (``cluster.rewards.pool``).
"""

from __future__ import annotations

import os

import ray

from cluster.rewards.inline import InlineRewardPool
from cluster.rewards.pool import WorkerLost, WorkerPool
from cluster.rewards.worker import RewardPlan, RewardWorkerCore, WireError, WireScores, build_plan, raise_wire_error
from cluster.ray_shell.pools import WorkerTimeout, get
from contract.rewards import RewardCall, RewardScores

__all__ = ["RayRewardWorker", "RewardActor", "ray_reward_pool"]


class RewardActor:
    """The reward worker actor's class: a :class:`RewardWorkerCore`, or why it could not be built (so a reward
    function that does not load is reported with its own message, not as a dead actor)."""

    def __init__(self, plan: RewardPlan):
        try:
            self.core, self.error = RewardWorkerCore(plan), None
        except Exception as exc:  # noqa: BLE001 - returned by ready(), raised in the driver
            self.core, self.error = None, WireError("reward", f"reward worker could not load the reward functions: "
                                                              f"{exc}")

    def ready(self) -> int | WireError:
        """The actor's pid, or the error that stopped it loading the reward functions."""
        return self.error if self.error is not None else os.getpid()

    def score(self, call: RewardCall) -> WireScores | WireError:
        """:meth:`RewardWorkerCore.score`."""
        return self.core.score(call)


class RayRewardWorker:
    """One reward worker actor (``cluster.rewards.pool.RewardWorker``), started and ready.

    Args:
        plan: the reward functions to load. spec: the job spec (``reward_pool``). index: its slot.

    Raises:
        RewardError: a reward function did not load in the actor. WorkerLost: the actor died or was not ready
            within ``reward_pool.start_timeout_s`` (e.g. no node has the CPUs it reserves).
    """

    def __init__(self, plan: RewardPlan, spec, index: int):
        rp = spec.reward_pool
        self.actor = ray.remote(RewardActor).options(
            num_cpus=rp.num_cpus_per_worker, resources=dict(rp.resources), max_restarts=0).remote(plan)
        what = f"reward worker {index} ({rp.num_cpus_per_worker:g} CPU, resources {dict(rp.resources)})"
        try:
            ready = get(self.actor.ready.remote(), rp.start_timeout_s, f"starting {what}")
        except WorkerTimeout as exc:
            self.close()
            raise WorkerLost(f"{exc} (reward_pool.start_timeout_s)", timed_out=True) from None
        except ray.exceptions.RayError as exc:
            self.close()
            raise WorkerLost(f"{what} died while starting: {type(exc).__name__}") from None
        if isinstance(ready, WireError):
            self.close()
            raise_wire_error(ready)
        self.pid = ready

    def call(self, call: RewardCall, timeout_s: float) -> RewardScores:
        """Score ``call`` on the actor (``cluster.rewards.pool.RewardWorker.call``)."""
        ref = self.actor.score.remote(call)
        done, _ = ray.wait([ref], timeout=timeout_s)
        if not done:
            raise WorkerLost(f"reward worker actor (pid {self.pid}) took more than {timeout_s:g} s to score "
                             f"{len(call)} completions (reward_pool.timeout_s)", timed_out=True)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise WorkerLost(f"reward worker actor (pid {self.pid}) died: {type(exc).__name__}") from None
        if isinstance(result, WireError):
            raise_wire_error(result)
        return result.scores()

    def close(self) -> None:
        """Kill the actor (idempotent)."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass


def ray_reward_pool(spec, imports: tuple[str, ...] = ()):
    """The job's reward pool on Ray: :class:`InlineRewardPool` with ``reward_pool.workers`` 0, else a
    :class:`WorkerPool` of :class:`RayRewardWorker` s for the functions of ``algorithm.rewards`` as this process has
    them registered (after the spec was validated); ``imports``: modules the actors import first (``--import``).
    Nothing touches Ray until the pool starts.

    Raises:
        RewardError: a reward function of the spec is not registered in this process.
    """
    rp = spec.reward_pool
    if rp.workers == 0:
        return InlineRewardPool()
    plan = build_plan(spec.algorithm.rewards, imports)
    return WorkerPool(lambda index: RayRewardWorker(plan, spec, index), rp.workers, rp.batch_size, rp.timeout_s,
                      "Ray actors", cores_per_worker=rp.num_cpus_per_worker)
