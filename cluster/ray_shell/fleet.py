"""The rollout engines on a Ray cluster as the loop sees them (``contract.protocols.Fleet``): generate and sync with
engine-fault replacement, re-sampling of stale groups, resizing, and the per-engine figures of a step.

Membership lives in the rollout pool (:class:`cluster.ray_shell.rollout_pool.RolloutPool`) and the weight-sync group
(:class:`cluster.ray_shell.sync.WeightSync`); the fleet keeps the two in step: an engine that dies is replaced, the sync
group rebuilt over the new members, and every engine brought to the trainer's policy version before it samples again.
Every policy version is read from, and every engine's report checked against, the ledger
(:class:`contract.versions.PolicyVersionLedger`).

Reliability: groups carry their own seeds (:func:`cluster.loop.requests.request_seed`), so re-sampling after a
replacement or a resync gives the same groups.

Request-level generation (``contract.requests.RequestServer``): :meth:`EngineFleet.submit` sends each request to an
engine actor as its own call (:mod:`cluster.ray_shell.requests`: dispatch, and the replacement of an engine that dies
with requests in flight, whose requests are sampled again from scratch); a weight sync pauses the requests an engine
is serving and they continue on the new version (the engines' own serving, ``rollout_workers``). Membership changes
(a replacement, a resync, scaling) hold :attr:`EngineFleet.membership`, since request faults are recovered from a
thread of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import ray

from cluster.ray_shell.pools import WorkerTimeout, wait_dead
from cluster.ray_shell.requests import RequestDispatch
from cluster.ray_shell.rollout_pool import RolloutPool
from cluster.ray_shell.sync import SyncMemberError, WeightSync
from cluster.spec.agents import context_tokens
from contract.errors import RecoveryDeferred
from contract.figures import FleetFigures
from contract.goodput import PoolTime
from contract.messages import EngineLoad, GroupRequest, GroupResult
from contract.requests import TokenRequest, TokenResult
from contract.staleness import StalenessGate
from contract.sync_reports import SyncReport
from contract.versions import PolicyVersionLedger

if TYPE_CHECKING:
    from cluster.sinks.metrics import MetricsLogger

#: Errors after which the fleet looks for dead or half-synced engines before giving up.
ENGINE_ERRORS = (ray.exceptions.RayError, WorkerTimeout, SyncMemberError)


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
        self._busy_s = 0.0  # engine-seconds of sampling over every generate call, accepted or not
        self._logged_engines = 0  # engines with Prometheus series
        self._status: Callable[[str], None] = print
        self.membership = threading.RLock()  # replacements, resyncs and scaling (request faults recover in a thread)
        self._figures_lock = threading.Lock()  # served requests' figures arrive on Ray's threads
        self._busy_seen: dict[int, float] = {}  # engine index → its newest busy counter (TokenResult.busy_s)
        self.requests: RequestDispatch | None = None  # built with the engines (attach)

    def check(self, model_path: str) -> None:
        """Before start: the engines' context fits the model's positions
        (:func:`cluster.data.model_checks.check_engine_context`; the ``rollout.engine``'s LoRA support is checked with
        ``train.lora``, :meth:`cluster.ray_shell.train_pool.RayTrainer.check`).

        Raises:
            ModelError: naming the spec field the context comes from and the model's limit.
        """
        from cluster.data.model_checks import check_engine_context
        from contract.model_source import ModelSource

        check_engine_context(self.spec, model_path, ModelSource.of(self.spec.model))

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
        max_model_len = r.max_model_len or context_tokens(r, self.spec.data.max_prompt_tokens)
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
        self.requests, self._busy_seen = RequestDispatch(self), {}
        self._check_infos(range(len(rollout.infos)))

    @property
    def num_engines(self) -> int:
        return len(self.rollout.engines) if self.rollout is not None else 0

    @property
    def restarts(self) -> int:
        return self.rollout.restarts if self.rollout is not None else 0

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the engines (pool ``rollout``), their sampling seconds so far and the
        cores they hold (``rollout.num_cpus_per_replica`` each)."""
        n = self.num_engines
        return [PoolTime("rollout", n, self._busy_s, cores=n * self.spec.rollout.num_cpus_per_replica)]

    def describe(self) -> str:
        buckets = f", {self.sync.num_buckets} sync bucket(s)" if self.sync is not None else ""
        return f"{self.num_engines} engine(s){buckets}"

    def shutdown(self) -> None:
        """Close the sync group, kill the engines and wait until they are gone (idempotent)."""
        if self.rollout is None:
            return
        if self.requests is not None:
            self.requests.shutdown()
        rollout, self.rollout, self.sync = self.rollout, None, None
        engines = list(rollout.engines)
        rollout.shutdown()
        wait_dead(engines)

    def begin_step(self, figures: FleetFigures | None = None) -> None:
        """Start a step's figures: afresh (the engines' busy counters as seen so far are the request window's base),
        or from a carried-over round's ``figures``."""
        with self._figures_lock:
            self.figures = figures if figures is not None else FleetFigures(engines=self.num_engines,
                                                                            busy_base=dict(self._busy_seen))

    # ---- request-level generation ---------------------------------------------------------------------------------
    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Serve one request on an engine (``contract.requests.RequestServer``; thread-safe): dispatch, pauses and
        faults as :mod:`cluster.ray_shell.requests` says.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self.rollout is None:
            raise RuntimeError("EngineFleet.submit: the fleet is not started")
        return self.requests.submit(request)

    def record_request(self, engine: int, result: TokenResult, submitted: float, done: float) -> None:
        """Add a served request to the step's figures (called on Ray's threads)."""
        with self._figures_lock:
            seen = self._busy_seen.get(engine, 0.0)
            self._busy_s += max(0.0, result.busy_s - seen)  # the engine's counter grew by what it served since
            self._busy_seen[engine] = max(seen, result.busy_s)
            self.figures.add_request(engine, result, submitted, done)

    def recover_engines(self, cause: BaseException) -> None:
        """After a request's engine died: replace the dead engines and sync the new group (under
        :attr:`membership`); nothing to do when a generate call's recovery already did.

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``, or no room for a replacement.
        """
        with self.membership:
            dead = self.rollout.dead_engines()
            if not dead:
                self.sync.ensure_current()
                return
            why = f"{type(cause).__name__}: {first_line(cause)}"
            self._status(f"rollout engine(s) {dead} failed serving requests ({why}; {self.rollout.where(dead)}); "
                         f"replacing them and sampling their requests again")
            self._replace(dead, why)
            self.resync(f"replacing engine(s) {dead}")

    def generate(self, requests: list[GroupRequest],
                 on_groups: Callable[[list[GroupResult]], None] | None = None,
                 record: bool = True, recover: bool = True, interrupt_epoch: int | None = None) -> list[GroupResult]:
        """Generate, replacing dead engines and re-sampling (same seeds → same groups) until every group comes from
        an engine at a version within ``rollout.max_staleness`` of the trainer's (``versions.current``): the fleets'
        one staleness gate (:class:`contract.staleness.StalenessGate`) over :meth:`RolloutPool.generate`.

        Returns the groups in request order; the accepted call's stats are added to :attr:`figures` when ``record``
        (held-out evaluation passes False: its calls are not the step's rollouts). ``recover=False`` (a generate that
        overlaps a train step) replaces and syncs nothing: the trainer's weights are changing, so a replaced engine
        could not be given the version the others sample with. ``interrupt_epoch`` (partial rollouts, with
        ``recover=False``): :meth:`interrupt` with that epoch stops the call early; groups with an ``"interrupted"``
        completion come back as they are (``GroupResult.complete`` False), for the caller to resume.

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``.
            StaleSamplesError: engines stay stale after being synced again (``contract.staleness``).
            PolicyVersionError: a group was sampled at a version ahead of the trainer's.
            RecoveryDeferred: with ``recover=False``, an engine died or is half-synced, or groups came back stale.
        """
        extra = {} if interrupt_epoch is None else {"interrupt_epoch": interrupt_epoch}

        def on_fault(exc: BaseException) -> bool:
            if not recover and (self.rollout.dead_engines() or self.versions.stale_engines()):
                raise RecoveryDeferred(f"engine fault during a generate that overlaps training "
                                       f"({type(exc).__name__}: {first_line(exc)}); {len(requests)} group(s) "
                                       f"to sample again after the sync") from exc
            return recover and self._recover(exc, len(requests))

        def once():
            groups, stats = self.rollout.generate(requests, on_groups, **extra)
            self._busy_s += sum(stats.engine_seconds)  # accepted or not: the engines spent it
            return groups, stats

        gate = StalenessGate(self.versions, self.spec.rollout.max_staleness, self.resync, self._status)
        return gate.run(once, figures=lambda: self.figures,
                        record=record, recover=recover, attempts=self.spec.rollout.max_engine_restarts + 3,
                        faults=ENGINE_ERRORS, on_fault=on_fault)

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
        with self.membership:
            return self._recover_held(exc, num_groups)

    def _recover_held(self, exc: BaseException, num_groups: int) -> bool:
        """:meth:`_recover` under :attr:`membership`."""
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
        """Replace the engines at ``indices`` (:meth:`RolloutPool.replace`) and check their start-up reports (a new
        engine's busy counter starts at 0)."""
        self.rollout.replace(indices, self.versions.current, cause)
        with self._figures_lock:
            self._busy_seen.update((i, 0.0) for i in indices)
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
        with self.membership:
            return self._sync_held()

    def _sync_held(self) -> SyncReport:
        """:meth:`sync_policy` under :attr:`membership`."""
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
        with self.membership:
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
        with self.membership:
            self._scale_held(replicas)

    def _scale_held(self, replicas: int) -> None:
        """:meth:`scale` under :attr:`membership`."""
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
