"""The rollout pool: ``rollout.replicas`` rollout engine actors (the ``rollout.engine`` of
``rollout_workers.registry``), each in its own placement group, with load-balanced group dispatch and membership
changes between steps (add, remove, replace)."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from cluster.loop.scheduler import assign_groups
from cluster.ray_shell.pools import (EngineFailure, InsufficientResources, WorkerTimeout, _in_group, _kill,
                                     _pool_placement_group, get)
from contract.messages import EngineInfo, EngineLoad, GroupRequest, GroupResult, PoolGenerateStats
from cluster.ray_shell.requests import REQUEST_GROUP
from contract.model_source import ModelSource
from rollout_workers.registry import rollout_engine


def request_slots(spec) -> int:
    """Threads of an engine actor's ``requests`` concurrency group (``cluster.ray_shell.requests``): each waits on one
    served request, so at least the requests a step can have in flight at once — every episode of two batches
    (``rollout.mode: async`` runs the next while one trains), 2·B·G — and 64; at most 4096."""
    r = spec.rollout
    return max(64, min(4096, 2 * r.prompts_per_step * r.group_size))


class RolloutPool:
    """``rollout.replicas`` engine actors, each a :class:`contract.rollout_engine.RolloutEngine` of the spec's
    ``rollout.engine``.

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
        # (every engine keeps generate and the weight sync apart itself); served requests wait in their own group
        concurrency = {"max_concurrency": 2} if r.partial_rollout else {}
        engine = ray.remote(concurrency_groups={REQUEST_GROUP: request_slots(self.spec)})(
            rollout_engine(r.engine)).options(
            num_cpus=bundles[0]["CPU"], num_gpus=bundles[0]["GPU"], resources=dict(r.resources), **_in_group(pg),
            **concurrency,
        ).remote(self.model_path, r, self.spec.model.dtype, self.spec.seed + index, self.max_model_len,
                 policy_version, lora=self.spec.train.lora, source=ModelSource.of(self.spec.model))
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
            tokens=tokens, engine_seconds=busy, engine_idle_fraction=idle, per_engine=per_engine,
            capacity_seconds=len(self.engines) * wall)
