"""The rollout engines on a Ray cluster as the loop sees them (``contract.protocols.Fleet``): generate and sync with
engine-fault replacement, re-sampling of stale groups, resizing, and the per-engine figures of a step.

Membership lives in the rollout pool (:class:`cluster.ray_shell.pools.RolloutPool`) and the weight-sync group
(:class:`cluster.ray_shell.sync.WeightSync`); the fleet keeps the two in step: an engine that dies is replaced, the sync
group rebuilt over the new members, and every engine brought to the trainer's policy version before it samples again.
Every policy version is read from, and every engine's report checked against, the ledger
(:class:`contract.versions.PolicyVersionLedger`).

Reliability: groups carry their own seeds (:func:`cluster.loop.requests.request_seed`), so re-sampling after a
replacement or a resync gives the same groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from cluster.ray_shell.pools import WorkerTimeout, wait_dead
from cluster.ray_shell.rollout_pool import RolloutPool
from cluster.ray_shell.sync import SyncMemberError, WeightSync
from cluster.spec.multi_turn import generated_tokens
from contract.errors import RecoveryDeferred
from contract.figures import FleetFigures
from contract.messages import EngineLoad, GroupRequest, GroupResult, SyncReport
from contract.versions import PolicyVersionLedger

if TYPE_CHECKING:
    from cluster.ops.metrics import MetricsLogger

#: Errors after which the fleet looks for dead or half-synced engines before giving up.
ENGINE_ERRORS = (ray.exceptions.RayError, WorkerTimeout, SyncMemberError)


class StaleSamplesError(RuntimeError):
    """Engines kept returning samples older than ``rollout.max_staleness`` after being synced again."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class EngineFleet:
    """Generate and sync over the rollout pool, replacing engines that fail (``contract.protocols.Fleet`` on Ray).

    Built unstarted from the spec; :meth:`start` starts the engines (``ray.init`` must have been called) and joins
    them with the trainer's rank 0 in the weight-sync group. :meth:`attach` wires an already built pool and sync
    group (tests give stand-ins).

    Args:
        spec: the job spec (``rollout``: replicas, restarts, staleness; ``sync``: verification).

    Raises:
        PolicyVersionError: an engine reports a version ahead of the trainer's.
    """

    def __init__(self, spec):
        self.spec = spec
        self.rollout: RolloutPool | None = None
        self.sync: WeightSync | None = None
        self.versions = None
        self.figures = FleetFigures()
        self._logged_engines = 0  # engines with Prometheus series
        self._status: Callable[[str], None] = print

    def check(self, model_path: str) -> None:
        """Nothing to check before start beyond the trainer's checks (vLLM's LoRA support is checked with
        ``train.lora``, :meth:`cluster.ray_shell.train_pool.RayTrainer.check`)."""

    def start(self, weights_path: str, policy_version: int, trainer, versions: PolicyVersionLedger,
              status: Callable[[str], None]) -> None:
        """Start ``rollout.replicas`` engines from ``weights_path`` (policy version ``policy_version``) and form the
        weight-sync group with ``trainer``'s rank 0.

        Raises:
            TypeError: ``trainer`` is not a :class:`cluster.ray_shell.train_pool.RayTrainer` (started).
            EngineFailure, WorkerTimeout, SyncMemberError: an engine or the group did not start (nothing stays up).
        """
        pool = getattr(trainer, "pool", None)
        if pool is None:
            raise TypeError(f"EngineFleet.start: expected a started RayTrainer, got {type(trainer).__name__}")
        r = self.spec.rollout
        max_model_len = r.max_model_len or self.spec.data.max_prompt_tokens + generated_tokens(r)
        rollout = RolloutPool(self.spec, weights_path, max_model_len, policy_version)
        try:
            sync = WeightSync(self.spec, pool, rollout, versions)
        except BaseException:
            rollout.shutdown()
            raise
        self.attach(rollout, sync, versions, status)

    def attach(self, rollout: RolloutPool, sync: WeightSync, versions: PolicyVersionLedger,
               status: Callable[[str], None]) -> None:
        """Serve over ``rollout`` and ``sync`` with the ledger ``versions`` (what :meth:`start` builds)."""
        self.rollout, self.sync, self.versions, self._status = rollout, sync, versions, status
        self._check_infos(range(len(rollout.infos)))

    @property
    def num_engines(self) -> int:
        return len(self.rollout.engines) if self.rollout is not None else 0

    @property
    def restarts(self) -> int:
        return self.rollout.restarts if self.rollout is not None else 0

    def describe(self) -> str:
        buckets = f", {self.sync.num_buckets} sync bucket(s)" if self.sync is not None else ""
        return f"{self.num_engines} engine(s){buckets}"

    def shutdown(self) -> None:
        """Close the sync group, kill the engines and wait until they are gone (idempotent)."""
        if self.rollout is None:
            return
        rollout, self.rollout, self.sync = self.rollout, None, None
        engines = list(rollout.engines)
        rollout.shutdown()
        wait_dead(engines)

    def begin_step(self) -> None:
        """Start a step's figures afresh."""
        self.figures = FleetFigures()

    def generate(self, requests: list[GroupRequest],
                 on_groups: Callable[[list[GroupResult]], None] | None = None,
                 record: bool = True, recover: bool = True, interrupt_epoch: int | None = None) -> list[GroupResult]:
        """Generate, replacing dead engines and re-sampling (same seeds → same groups) until every group comes from
        an engine at a version within ``rollout.max_staleness`` of the trainer's (``versions.current``).

        Returns the groups in request order; the accepted call's stats are added to :attr:`figures` when ``record``
        (held-out evaluation passes False: its calls are not the step's rollouts). ``recover=False`` (a generate that
        overlaps a train step) replaces and syncs nothing: the trainer's weights are changing, so a replaced engine
        could not be given the version the others sample with. ``interrupt_epoch`` (partial rollouts, with
        ``recover=False``): :meth:`interrupt` with that epoch stops the call early; groups with an ``"interrupted"``
        completion come back as they are (``GroupResult.complete`` False), for the caller to resume.

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``.
            StaleSamplesError: engines stay stale after being synced again.
            PolicyVersionError: a group was sampled at a version ahead of the trainer's.
            RecoveryDeferred: with ``recover=False``, an engine died or is half-synced, or groups came back stale.
        """
        r = self.spec.rollout
        for attempt in range(r.max_engine_restarts + 3):
            try:
                extra = {} if interrupt_epoch is None else {"interrupt_epoch": interrupt_epoch}
                groups, stats = self.rollout.generate(requests, on_groups, **extra)
            except ENGINE_ERRORS as exc:
                if not recover and (self.rollout.dead_engines() or self.versions.stale_engines()):
                    raise RecoveryDeferred(f"engine fault during a generate that overlaps training "
                                           f"({type(exc).__name__}: {first_line(exc)}); {len(requests)} group(s) "
                                           f"to sample again after the sync") from exc
                if not recover or not self._recover(exc, len(requests)):
                    raise
                continue
            stale = [g for g in groups if self.versions.staleness(g.policy_version) > r.max_staleness]
            if not stale:
                if record:
                    self.figures.add(stats)
                return groups
            if not recover:
                raise RecoveryDeferred(f"{len(stale)} stale group(s) during a generate that overlaps training")
            self._status(f"{len(stale)} group(s) sampled at policy version {min(g.policy_version for g in stale)} "
                         f"(trainer {self.versions.current}, rollout.max_staleness={r.max_staleness}); re-syncing "
                         f"and sampling again")
            self.figures.stale_refused += len(stale)
            self.resync("stale samples")
        raise StaleSamplesError(f"engines still returned stale or failed samples after {attempt + 1} attempts")

    def interrupt(self, epoch: int) -> None:
        """Partial rollouts: stop every engine's generate calls of ``interrupt_epoch`` <= ``epoch`` at their next
        engine step (``RolloutPool.interrupt``). An engine that died or stalls is not an error here: the generate
        call it holds fails and is handled by :meth:`generate`'s caller."""
        try:
            self.rollout.interrupt(epoch)
        except ENGINE_ERRORS as exc:
            self._status(f"interrupting the engines: {type(exc).__name__}: {first_line(exc)}")

    def _recover(self, exc: BaseException, num_groups: int) -> bool:
        """After a failed generate call: sync engines that hold no complete policy, or replace dead ones and sync
        the new group. Returns False when no engine is dead or half-synced (the error is not an engine fault)."""
        dead = self.rollout.dead_engines()
        if not dead and self.versions.stale_engines():
            # alive, but holding no complete policy (a sync failed part-way): sync again, then re-sample
            self._status(f"engine(s) {self.versions.stale_engines()} hold no complete policy "
                         f"({type(exc).__name__}); syncing them and re-sampling")
            self.sync.ensure_current()
            return True
        if not dead:
            return False
        cause = f"{type(exc).__name__}: {first_line(exc)}"
        self._status(f"rollout engine(s) {dead} failed ({cause}; {self.rollout.where(dead)}); replacing and "
                     f"re-sampling {num_groups} group(s)")
        self._replace(dead, cause)
        self.resync(f"replacing engine(s) {dead}")
        return True

    def _replace(self, indices: list[int], cause: str) -> None:
        """Replace the engines at ``indices`` (:meth:`RolloutPool.replace`) and check their start-up reports."""
        self.rollout.replace(indices, self.versions.current, cause)
        self._check_infos(indices)

    def _check_infos(self, indices) -> None:
        """Check the start-up reports (``EngineInfo``) of the engines at ``indices`` against the ledger."""
        for i in indices:
            self.versions.check_engine(self.rollout.infos[i].policy_version, f"engine {i}")

    def sync_policy(self) -> SyncReport:
        """Sync the trainer's version (``versions.current``) to every engine; an engine that dies or stalls during
        the sync (an error within ``sync.timeout_s``) is replaced, and the new group is synced before anything is
        sampled.

        Returns the sync's report (``.metrics()``: the ``sync/*`` metrics).

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``.
            SyncVerificationError: an engine's weights differ from the trainer's (not retried: names the tensor).
        """
        try:
            return self.sync.sync()
        except ENGINE_ERRORS as exc:
            dead = self.rollout.dead_engines()
            if not dead:
                raise
            cause = f"{type(exc).__name__} during weight sync: {first_line(exc)}"
            self._status(f"rollout engine(s) {dead} failed ({cause}; {self.rollout.where(dead)}); replacing them")
            self._replace(dead, cause)
            self.sync.rebuild(self.rollout.engines)
            return self.sync.sync()

    def resync(self, why: str) -> None:
        """Rebuild the sync group over the current engines and bring all of them to the trainer's version.

        Raises:
            RuntimeError: ``sync.verify`` is on and the sync was not verified (naming ``why``).
        """
        self.sync.rebuild(self.rollout.engines)
        report = self.sync.sync()
        if self.spec.sync.verify and not report.verified:
            raise RuntimeError(f"weight sync after {why} was not verified")

    def scale(self, replicas: int) -> None:
        """Resize the pool to ``replicas`` engines between steps.

        New engines join the weight-sync group and receive the trainer's version before they serve; removed engines
        hold no in-flight groups (nothing is generated between steps, also in ``rollout.mode: one_step_off``, whose
        prefetch ends before the sync), so no prompt is lost.

        Raises:
            ValueError: ``replicas`` < 1.
        """
        if replicas < 1:
            raise ValueError(f"rollout replicas must be >= 1, got {replicas}")
        have = len(self.rollout.engines)
        if replicas == have:
            return
        if replicas > have:
            self.rollout.add(replicas - have, self.versions.current)
            self._check_infos(range(have, replicas))
        else:
            self.rollout.remove(have - replicas)
        self.resync(f"rollout pool scaled {have} -> {replicas}")
        self._status(f"rollout pool scaled from {have} to {replicas} engine(s) at policy version "
                     f"{self.versions.current}")

    def log_workers(self, metrics: MetricsLogger, step: int, figures: FleetFigures | None = None) -> None:
        """Per-engine figures of the step for Prometheus (worker label) and ``workers.jsonl``, at the trainer's
        version; series of engines removed by a scale-down are dropped. ``figures``: those of the batch the step
        trained on (``rollout.mode: one_step_off`` generates it during the previous step); None: :attr:`figures`."""
        figures = figures if figures is not None else self.figures
        idle = EngineLoad(groups=0)
        for i in range(len(self.rollout.infos)):
            e = figures.per_engine.get(i, idle)
            metrics.log_worker(step, "rollout", f"engine-{i}", {
                "policy_version": float(self.versions.current),
                "perf/rollout_tokens_per_s": e.tokens / e.seconds if e.seconds > 0 else 0.0,
                "rollout/queue_depth": float(e.groups),  # groups dispatched to this engine this step
                "rollout/engine_busy_s": e.seconds,
                "rollout/kv_cache_usage": float(e.kv_cache_usage or 0.0),  # estimated peak this step
                "workers/restarts": float(self.rollout.restarts),
            })
        for i in range(len(self.rollout.infos), self._logged_engines):
            metrics.remove_worker("rollout", f"engine-{i}")
        self._logged_engines = len(self.rollout.infos)
