"""What the Ray pools share: their failure types, the job's resource needs, ``ray.get`` with a deadline, placement
groups and actor shutdown.

The pools themselves are :class:`cluster.ray_shell.rollout_pool.RolloutPool` (rollout engine actors) and
:class:`cluster.ray_shell.train_pool.TrainPool` (train ranks of the backend ``train.strategy`` names); they own actor
creation (resources from the spec), the calls that must reach every member together, and timeouts (every
``ray.get`` names the operation and its limit). The weight-sync group joining train rank 0 with every engine worker
is :class:`cluster.ray_shell.sync.WeightSync`.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.spec.agents import uses_agent_pool


class WorkerTimeout(TimeoutError):
    """A remote call did not finish within its limit."""


class InsufficientResources(RuntimeError):
    """The Ray cluster lacks the CPUs/GPUs the spec's pools ask for."""


class EngineFailure(RuntimeError):
    """Rollout engines died more often than ``rollout.max_engine_restarts`` allows, or a dead engine could not be
    replaced (e.g. its node was lost and no live node can hold a new one)."""


class TrainWorkerFailure(RuntimeError):
    """A train rank died or failed; the message names the rank, the operation and the cause."""


def resources_needed(spec) -> dict[str, tuple[float, str]]:
    """What the job's pools reserve in all, per resource: CPUs, GPUs and the custom resources (``rollout.resources``
    per replica, ``train.resources`` per rank, ``reward_pool.resources`` per reward worker,
    ``rollout.agent_pool.resources`` per agent worker), e.g.
    ``{"CPU": (2.0, "rollout 1 x 1 + train 2 x 0.5"), ...}``. A reward pool without workers reserves nothing."""
    r, t, w = spec.rollout, spec.train, spec.reward_pool
    pools = [("rollout", r.replicas, {"CPU": r.num_cpus_per_replica, "GPU": r.num_gpus_per_replica, **r.resources}),
             ("train", t.world_size, {"CPU": t.num_cpus_per_worker, "GPU": t.num_gpus_per_worker, **t.resources})]
    if w.workers:
        pools.append(("reward", w.workers, {"CPU": w.num_cpus_per_worker, **w.resources}))
    if uses_agent_pool(r):
        a = r.agent_pool
        pools.append(("agent", a.workers, {"CPU": a.num_cpus_per_worker, **a.resources}))
    names = ["CPU", "GPU"] + sorted({k for _, _, per in pools for k in per} - {"CPU", "GPU"})
    return {res: (sum(count * per.get(res, 0.0) for _, count, per in pools),
                  " + ".join(f"{pool} {count} x {per[res]:g}" for pool, count, per in pools if res in per))
            for res in names}


def reserving_fields(spec, resource: str) -> list[str]:
    """The spec fields that reserve ``resource`` (``"CPU"``, ``"GPU"`` or a custom one) with a non-zero amount, e.g.
    ``["rollout.num_gpus_per_replica", "train.num_gpus_per_worker"]``: what a shortage message tells the user to
    change. A reward pool without workers reserves nothing."""
    r, t, w = spec.rollout, spec.train, spec.reward_pool
    agents = uses_agent_pool(r)
    per = {"CPU": [("rollout.num_cpus_per_replica", r.num_cpus_per_replica),
                   ("train.num_cpus_per_worker", t.num_cpus_per_worker)]
                  + ([("reward_pool.num_cpus_per_worker", w.num_cpus_per_worker)] if w.workers else [])
                  + ([("rollout.agent_pool.num_cpus_per_worker", r.agent_pool.num_cpus_per_worker)] if agents else []),
           "GPU": [("rollout.num_gpus_per_replica", r.num_gpus_per_replica),
                   ("train.num_gpus_per_worker", t.num_gpus_per_worker)]}
    if resource in per:
        return [name for name, amount in per[resource] if amount]
    pools = [("rollout", r.resources), ("train", t.resources)] + ([("reward_pool", w.resources)] if w.workers else [])
    pools += [("rollout.agent_pool", r.agent_pool.resources)] if agents else []
    return [f"{section}.resources.{resource}" for section, resources in pools if resources.get(resource)]


def check_cluster_resources(spec, have: dict[str, float] | None = None) -> None:
    """Fail at once, listing what is missing, when the cluster cannot hold the pools (Ray would wait forever).

    Compares the cluster's totals with ``resources_needed(spec)``; whether they fit node by node is the placement
    groups' check.

    Args:
        spec: the validated JobSpec.
        have: the cluster's total resources; default ``ray.cluster_resources()`` of the connected cluster.
    Raises:
        InsufficientResources: e.g. ``needs GPU 3 (rollout 1 x 1 + train 2 x 1), cluster has 0 (set by
            rollout.num_gpus_per_replica, train.num_gpus_per_worker)``.
    """
    have = ray.cluster_resources() if have is None else have
    missing = [f"{res} {amount:g} ({how}), cluster has {have.get(res, 0):g} (set by "
               f"{', '.join(reserving_fields(spec, res))})"
               for res, (amount, how) in resources_needed(spec).items() if amount > have.get(res, 0) + 1e-9]
    if missing:
        raise InsufficientResources("the Ray cluster cannot hold this job: needs " + "; needs ".join(missing))


def get(refs, timeout_s: float, what: str):
    """``ray.get`` with a deadline: returns the results, or raises the first failure as soon as it happens.

    Waiting object by object (``ray.wait``) surfaces a dead actor's error at once instead of after its peers' own
    timeouts, and a stalled one as :class:`WorkerTimeout` naming ``what`` after ``timeout_s`` seconds.

    Raises:
        WorkerTimeout: not all results arrived within ``timeout_s``.
        ray.exceptions.RayError: a task failed or its actor died (the original Ray error).
    """
    single = isinstance(refs, ray.ObjectRef)
    pending = [refs] if single else list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0.0))
        if not ready:
            raise WorkerTimeout(f"{what} did not finish within {timeout_s:g} s")
        ray.get(ready[0])  # raises this task's error now
    return ray.get(refs)


def _pool_placement_group(bundles: list[dict], strategy: str, name: str, timeout_s: float):
    """A Ray placement group, ready; or :class:`InsufficientResources` naming the pool, its bundles and what the
    cluster has available now (CPU, GPU, memory and the bundles' custom resources).

    Bundles with no resources at all (``num_cpus: 0``, no GPU, no custom resources) need no reservation: returns None
    for them.
    """
    bundles = [{k: v for k, v in b.items() if v > 0} for b in bundles]
    if not all(bundles):
        return None
    pg = placement_group(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise InsufficientResources(
            f"{name}: placement group {bundles} (strategy {strategy}) could not be placed within {timeout_s:g} s; "
            f"available now: {_fmt_resources(ray.available_resources(), {k for b in bundles for k in b})}")
    return pg


def _fmt_resources(res: dict, asked: set[str] = frozenset()) -> str:
    """``"CPU 1, memory 22.9 GiB, rollout_node 0"``: CPU, GPU, memory, accelerator types, and the ``asked``
    resources (0 when absent)."""
    shown = {k: f"{v:g}" for k, v in res.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type")}
    shown.update({k: f"{res.get(k, 0.0):g}" for k in asked if k != "memory"})
    if "memory" in res:
        shown["memory"] = f"{res['memory'] / 2**30:.1f} GiB"
    return ", ".join(f"{k} {v}" for k, v in sorted(shown.items())) or "none"


def _in_group(pg, bundle_index: int = 0) -> dict:
    """Actor options that place it in bundle ``bundle_index`` of ``pg`` (children it spawns stay in the group)."""
    if pg is None:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True)}


def _dead_actor_index(actors: list, exc: BaseException) -> int | None:
    """Index of the actor a Ray error came from, when the error names it."""
    actor_id = getattr(exc, "actor_id", None)
    if actor_id is None:
        return None
    for i, a in enumerate(actors):
        if a._actor_id.hex() == actor_id:
            return i
    return None


def _kill(actor, pg) -> None:
    """Stop an actor (no restart) and free its placement group; already-dead actors are fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - the actor may be gone already
        pass
    if pg is not None:
        remove_placement_group(pg)


def wait_dead(actors: list, timeout_s: float = 60.0) -> None:
    """Wait until the killed ``actors`` are gone (their processes, and the ports they listened on, released) before
    new pools start on the same nodes; one still alive after ``timeout_s`` is left to Ray."""
    for actor in actors:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - RayActorError: dead, as wanted; GetTimeoutError: left to Ray
            pass
