"""Worker pools: Ray actors for the rollout engines and the train ranks (the backend ``train.strategy`` names).

The pools own actor creation (resources from the spec), the calls that must reach every member together, and
timeouts (every ``ray.get`` names the operation and its limit). The weight-sync group joining train rank 0 with every
engine worker is :class:`cluster.ray_shell.sync.WeightSync`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.loop.scheduler import assign_groups
from contract.messages import (EngineInfo, EngineLoad, GroupRequest, GroupResult, PoolGenerateStats, TrainRankInfo,
                              TrainResult)
from rollout_workers.engine import RolloutEngine
from train_workers.registry import train_backend


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
    per replica, ``train.resources`` per rank), e.g. ``{"CPU": (2.0, "rollout 1 x 1 + train 2 x 0.5"), ...}``."""
    r, t = spec.rollout, spec.train
    pools = [("rollout", r.replicas, {"CPU": r.num_cpus_per_replica, "GPU": r.num_gpus_per_replica, **r.resources}),
             ("train", t.world_size, {"CPU": t.num_cpus_per_worker, "GPU": t.num_gpus_per_worker, **t.resources})]
    names = ["CPU", "GPU"] + sorted({k for _, _, per in pools for k in per} - {"CPU", "GPU"})
    return {res: (sum(count * per.get(res, 0.0) for _, count, per in pools),
                  " + ".join(f"{pool} {count} x {per[res]:g}" for pool, count, per in pools if res in per))
            for res in names}


def check_cluster_resources(spec, have: dict[str, float] | None = None) -> None:
    """Fail at once, listing what is missing, when the cluster cannot hold the pools (Ray would wait forever).

    Compares the cluster's totals with ``resources_needed(spec)``; whether they fit node by node is the placement
    groups' check.

    Args:
        spec: the validated JobSpec.
        have: the cluster's total resources; default ``ray.cluster_resources()`` of the connected cluster.
    Raises:
        InsufficientResources: e.g. ``needs GPU 3 (rollout 1 x 1 + train 2 x 1), cluster has 0``.
    """
    have = ray.cluster_resources() if have is None else have
    missing = [f"{res} {amount:g} ({how}), cluster has {have.get(res, 0):g}"
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


class RolloutPool:
    """``rollout.replicas`` vLLM engine actors.

    Groups are dispatched by load (:func:`cluster.loop.scheduler.assign_groups`): each prompt's whole group goes to the
    engine with the fewest tokens in flight (prompt + G × max_response_tokens), heaviest first, so engines finish
    together and a group's G samples share one engine's prefix cache. Each engine lives in its own STRICT_PACK
    placement group; ``add``/``remove``/``replace`` change membership between steps.
    """

    def __init__(self, spec, model_path: str, max_model_len: int, policy_version: int = 0):
        self.spec = spec
        self.model_path, self.max_model_len = model_path, max_model_len
        self.engines: list = []
        self.placement_groups: list = []
        self.infos: list[EngineInfo] = []  # per engine: pid, node id, device ids, read from the engine itself
        self.restarts = 0
        self._spawned = 0
        self.add(spec.rollout.replicas, policy_version)

    def _spawn(self, policy_version: int):
        """One engine actor in its own placement group: STRICT_PACK so a multi-GPU (tensor-parallel) engine's
        workers share a node; its bundles hold the replica's CPUs and GPUs, the first one (the actor's) also
        ``rollout.resources``."""
        r = self.spec.rollout
        index, self._spawned = self._spawned, self._spawned + 1
        tp = r.tensor_parallel_size
        if r.num_gpus_per_replica > 0 and tp > 1:
            bundles = [{"CPU": r.num_cpus_per_replica / tp, "GPU": r.num_gpus_per_replica / tp}] * tp
        else:
            bundles = [{"CPU": r.num_cpus_per_replica, "GPU": r.num_gpus_per_replica}]
        bundles[0] = {**bundles[0], **r.resources}  # the engine actor's own bundle holds the custom resources
        pg = _pool_placement_group(bundles, "STRICT_PACK", f"{self.spec.name}-rollout-{index}",
                                   min(r.timeout_s, 120.0))
        # partial rollouts: a second concurrency slot, so interrupt() reaches the engine while generate() runs
        # (RolloutEngine's engine lock keeps generate and the weight sync apart)
        concurrency = {"max_concurrency": 2} if r.partial_rollout else {}
        engine = ray.remote(RolloutEngine).options(
            num_cpus=bundles[0]["CPU"], num_gpus=bundles[0]["GPU"], resources=dict(r.resources), **_in_group(pg),
            **concurrency,
        ).remote(self.model_path, r, self.spec.model.dtype, self.spec.seed + index, self.max_model_len,
                 policy_version, lora=self.spec.train.lora)
        return engine, pg

    def add(self, count: int, policy_version: int) -> list:
        """Start ``count`` engines holding ``model_path``'s weights (``policy_version``); returns their handles.

        New engines must be synced to the current policy before they serve (the driver rebuilds the sync group and
        syncs them).
        """
        spawned = [self._spawn(policy_version) for _ in range(count)]
        engines = [e for e, _ in spawned]
        try:
            infos = get([e.ready.remote() for e in engines], self.spec.rollout.timeout_s,
                        f"starting {count} rollout engine(s)")
        except BaseException:
            for e, pg in spawned:
                _kill(e, pg)
            raise
        self.engines += engines
        self.placement_groups += [pg for _, pg in spawned]
        self.infos += infos
        return engines

    def remove(self, count: int) -> list:
        """Stop the ``count`` most recently added engines (between steps: they hold no in-flight groups)."""
        if not 0 <= count < len(self.engines):
            raise ValueError(f"cannot remove {count} of {len(self.engines)} engines (at least one must stay)")
        removed = []
        for _ in range(count):
            engine, pg = self.engines.pop(), self.placement_groups.pop()
            self.infos.pop()
            _kill(engine, pg)
            removed.append(engine)
        return removed

    def dead_engines(self, timeout_s: float = 30.0) -> list[int]:
        """Indices of engines that do not answer a liveness probe within ``timeout_s`` (dead or stalled)."""
        refs = [e.ready.remote() for e in self.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                dead.append(i)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                dead.append(i)
        return dead

    def where(self, indices: list[int]) -> str:
        """Where the engines at ``indices`` ran and whether that Ray node is alive, e.g.
        ``"engine 0 on node 3f2a9c01 (10.0.0.7, node dead)"``: node ids come from each engine's own start-up report
        (``ready``), liveness from ``ray.nodes()`` now. Ray marks a lost node dead only after missed health checks
        (seconds to tens of seconds): until then it reads ``node still reported alive``."""
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        parts = []
        for i in indices:
            node_id = self.infos[i].node_id if i < len(self.infos) else None
            node = nodes.get(node_id)
            if node_id is None:
                parts.append(f"engine {i} on an unknown node")
                continue
            state = "node still reported alive" if node is not None and node.get("Alive") else "node dead"
            address = node.get("NodeManagerAddress", "?") if node is not None else "?"
            parts.append(f"engine {i} on node {node_id[:8]} ({address}, {state})")
        return "; ".join(parts)

    def replace(self, indices: list[int], policy_version: int, cause: str) -> None:
        """Replace the engines at ``indices`` with fresh ones (``model_path`` weights: sync them before serving).

        A replacement is placed like any engine (its own placement group, ``rollout.resources`` included), waiting
        at most ``min(rollout.timeout_s, 120)`` s for room: a node lost with its engine may come back (an autoscaler,
        a restarted pod) or another node may hold the resources.

        Raises:
            EngineFailure: replacements would exceed ``rollout.max_engine_restarts``, or a replacement could not be
                placed in time; names the engine, ``cause``, the engine's node and whether Ray now reports it dead
                (:meth:`where`, read when raising), and the resources missing.
        """
        limit = self.spec.rollout.max_engine_restarts
        if self.restarts + len(indices) > limit:
            raise EngineFailure(f"rollout engine(s) {indices} failed ({cause}; {self.where(indices)}); "
                                f"{self.restarts} replacement(s) already made and rollout.max_engine_restarts={limit}: "
                                f"stopping")
        for i in indices:
            _kill(self.engines[i], self.placement_groups[i])
            self.placement_groups[i] = None  # freed: shutdown must not remove it twice
            try:
                engine, pg = self._spawn(policy_version)
            except InsufficientResources as exc:
                raise EngineFailure(f"rollout engine {i} failed ({cause}; {self.where([i])}) and no replacement "
                                    f"could be placed: {exc}") from exc
            self.infos[i] = get(engine.ready.remote(), self.spec.rollout.timeout_s, f"starting replacement engine {i}")
            self.engines[i], self.placement_groups[i] = engine, pg
            self.restarts += 1

    def shutdown(self) -> None:
        for engine, pg in zip(self.engines, self.placement_groups):
            _kill(engine, pg)
        self.engines, self.placement_groups, self.infos = [], [], []

    def interrupt(self, epoch: int, timeout_s: float = 30.0) -> None:
        """Interrupt every engine's generate calls of ``interrupt_epoch`` <= ``epoch`` (partial rollouts:
        ``RolloutEngine.interrupt``, answered from the engine's second concurrency slot while its generate runs).

        Raises:
            WorkerTimeout: an engine did not acknowledge within ``timeout_s``.
            ray.exceptions.RayError: an engine died (its generate call fails too; the fleet recovers it).
        """
        get([e.interrupt.remote(epoch) for e in self.engines], timeout_s, f"interrupting the engines (epoch {epoch})")

    def generate(self, requests: list[GroupRequest],
                 on_groups: Callable[[list[GroupResult]], None] | None = None, interrupt_epoch: int | None = None
                 ) -> tuple[list[GroupResult], PoolGenerateStats]:
        """Sample one group per request across the engines; results come back in request order.

        Dispatch: :func:`cluster.loop.scheduler.assign_groups` (whole groups, by tokens in flight, heaviest first). Each
        engine gets one call; ``ray.wait`` collects the calls as they finish, and ``on_groups`` (when given) is called
        with each finished engine's groups at once, in completion order, so the caller can score them while the other
        engines still sample. ``interrupt_epoch`` (partial rollouts): the calls stop early, returning interrupted
        groups, once :meth:`interrupt` is called with an epoch >= it; None: they run to the end.

        Returns:
            (results in request order, :class:`PoolGenerateStats`): ``tokens`` (response tokens sampled),
            ``engine_seconds`` (each called engine's busy seconds, completion order), ``engine_idle_fraction`` = 1 −
            Σ busy engine-seconds / (num_engines × wall seconds of this call), in [0, 1]; engines that got no group
            count as idle throughout; ``per_engine``: per engine index, an :class:`EngineLoad` (``groups`` assigned,
            response ``tokens``, busy ``seconds``, estimated peak ``kv_cache_usage``).

        Raises:
            WorkerTimeout: the engines did not all finish within ``rollout.timeout_s``.
        """
        r = self.spec.rollout
        t0 = time.perf_counter()
        plan = assign_groups([len(q.prompt_ids) for q in requests], [q.group_size or r.group_size for q in requests],
                             len(self.engines), r.max_response_tokens)
        extra = () if interrupt_epoch is None else (interrupt_epoch,)
        calls = {e.generate.remote([requests[i] for i in idx], r.group_size, *extra): k
                 for k, (e, idx) in enumerate(zip(self.engines, plan)) if idx}
        pending = list(calls)
        per_engine = [EngineLoad(groups=len(idx)) for idx in plan]
        by_id, tokens, busy = {}, 0, []
        while pending:
            left = r.timeout_s - (time.perf_counter() - t0)
            done, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
            if not done:
                raise WorkerTimeout(f"generating {len(requests)} groups did not finish within {r.timeout_s:g} s "
                                    f"({len(pending)} engine call(s) still running)")
            results, stats = ray.get(done[0])  # (list[GroupResult], GenerateStats)
            k = calls[done[0]]
            per_engine[k] = EngineLoad(groups=per_engine[k].groups, tokens=stats.tokens, seconds=stats.seconds,
                                       kv_cache_usage=stats.kv_cache_usage)
            by_id.update((res.group_id, res) for res in results)
            tokens += stats.tokens
            busy.append(stats.seconds)
            if on_groups is not None:
                on_groups(results)
        wall = time.perf_counter() - t0
        idle = min(1.0, max(0.0, 1.0 - sum(busy) / (len(self.engines) * wall))) if wall > 0 else 0.0
        return [by_id[q.group_id] for q in requests], PoolGenerateStats(
            tokens=tokens, engine_seconds=busy, engine_idle_fraction=idle, per_engine=per_engine)


class TrainPool:
    """``train.world_size`` train ranks forming one data-parallel process group, placed by one placement group
    (``train.placement_strategy``: PACK/SPREAD/...; bundle i holds rank i). The rank class is the train backend
    registered under ``train.strategy`` (``train_workers.registry``; FSDP2's ``FSDPTrainWorker`` for ``fsdp``).

    ``policy_path`` (a checkpoint folder, on resume) initialises the policy; the reference policy is ``model_path``.
    Every call reaches every rank together, waits at most ``train.timeout_s`` and names the rank that failed
    (:class:`TrainWorkerFailure`).

    Attributes:
        workers: the rank actors, rank order. infos: each rank's :class:`TrainRankInfo`.
        num_parameters: of the policy.
    """

    def __init__(self, spec, model_path: str, policy_path: str | None = None):
        self.spec = spec
        t = spec.train
        bundle = {"CPU": t.num_cpus_per_worker, "GPU": t.num_gpus_per_worker, **t.resources}
        actor_cls = ray.remote(train_backend(t.strategy))
        self.placement_group = _pool_placement_group([bundle] * t.world_size, t.placement_strategy,
                                                     f"{spec.name}-train", min(t.timeout_s, 120.0))
        self.workers = [
            actor_cls.options(num_cpus=t.num_cpus_per_worker, num_gpus=t.num_gpus_per_worker,
                              resources=dict(t.resources), **_in_group(self.placement_group, rank)).remote(
                rank, t.world_size, model_path, t, spec.algorithm, spec.rollout.temperature,
                spec.rollout.max_response_tokens, spec.model.dtype, spec.seed,
                sampling_filters={"top_k": spec.rollout.top_k, "top_p": spec.rollout.top_p,
                                  "min_p": spec.rollout.min_p})
            for rank in range(t.world_size)
        ]
        try:
            addr, port = self._get(self.workers[0].node_address.remote(), t.timeout_s, "train rank 0 address")
            infos = self._get([w.init_distributed.remote(addr, port, policy_path) for w in self.workers],
                              t.timeout_s, f"building the {t.strategy} train group")
        except BaseException:
            self.shutdown()
            raise
        self.infos: list[TrainRankInfo] = infos
        self.num_parameters = infos[0].num_parameters

    def _get(self, refs, timeout_s: float, what: str):
        try:
            return get(refs, timeout_s, what)
        except ray.exceptions.RayError as exc:
            rank = _dead_actor_index(self.workers, exc)
            who = f"train rank {rank}" if rank is not None else "a train rank"
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TrainWorkerFailure(f"{who} failed during {what}: {type(exc).__name__}: {cause}") from exc

    def _all(self, call: Callable, what: str) -> list:
        """``call(worker)`` (an actor method call returning an ObjectRef) on every rank together; every rank's
        result in rank order, within ``train.timeout_s``."""
        return self._get([call(w) for w in self.workers], self.spec.train.timeout_s, what)

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β on every rank for the following train steps (adaptive KL controller)."""
        self._all(lambda w: w.set_kl_coef.remote(kl_coef), "setting kl_coef")

    def train_step(self, per_rank_microbatches: list, num_tokens: int, num_sequences: int) -> TrainResult:
        """One train step on every rank (rank r trains ``per_rank_microbatches[r]``).

        Args:
            num_tokens, num_sequences: loss tokens, and sequences with at least one, over the whole batch.

        Returns:
            rank 0's :class:`TrainResult` (metrics are reduced over ranks, so every rank's are the same).

        Raises:
            TrainWorkerFailure: a rank failed, or the ranks disagree on the policy version or the skip.
        """
        refs = [w.train_step.remote(mbs, num_tokens, num_sequences)
                for w, mbs in zip(self.workers, per_rank_microbatches)]
        results: list[TrainResult] = self._get(refs, self.spec.train.timeout_s, "train step")
        first = results[0]
        for rank, r in enumerate(results[1:], start=1):
            if (r.policy_version, r.skipped) != (first.policy_version, first.skipped):
                raise TrainWorkerFailure(
                    f"train rank {rank} disagrees with rank 0 after the train step: policy version "
                    f"{r.policy_version} vs {first.policy_version}, skipped {r.skipped} vs {first.skipped}")
        return first

    def sync_plan(self, dtype: str, bucket_bytes: int) -> list:
        """The weight-sync bucket plan (``weight_sync.buckets.Bucket`` list) of the policy in the engine ``dtype``,
        buckets of at most ``bucket_bytes`` bytes; every rank computes it (rank 0's is returned)."""
        return self._all(lambda w: w.sync_plan.remote(dtype, bucket_bytes), "planning weight-sync buckets")[0]

    def sync_adapter_config(self) -> dict | None:
        """Train rank 0's PEFT ``adapter_config.json`` (a dict) when the engines receive adapters
        (``train.lora.sync: adapter``), else None."""
        return self._get(self.workers[0].sync_adapter_config.remote(), self.spec.train.timeout_s,
                         "reading the adapter config")

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        """Every rank writes its part of a checkpoint (HF policy folder, sharded optimizer) into ``folder``;
        ``checkpoint`` names it in errors (default: ``folder``; the loop writes into a temporary folder)."""
        self._all(lambda w: w.save_checkpoint.remote(folder), f"saving checkpoint {checkpoint or folder}")

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Every rank loads its optimizer state from the checkpoint at ``path`` and continues at ``policy_version``.

        Returns:
            optimizer field → (saved value, value in use) for fields the spec changed since the checkpoint.
        """
        return self._all(lambda w: w.load_checkpoint.remote(path, policy_version), f"loading checkpoint {path}")[0]

    def shutdown(self) -> None:
        for w in self.workers:
            _kill(w, None)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _kill(actor, pg) -> None:
    """Stop an actor (no restart) and free its placement group; already-dead actors are fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - the actor may be gone already
        pass
    if pg is not None:
        remove_placement_group(pg)
