"""The in-process rollout side: :class:`LocalFleet` samples groups on the ``hf`` rollout engine in the calling process.

It implements :class:`contract.protocols.Fleet` with the semantics of the Ray shell's fleet
(``cluster.ray_shell.fleet.EngineFleet`` over engine actors):

- Its engine is the ``hf`` rollout engine (:class:`rollout_workers.hf.engine.HFEngine`, the one ``rollout.engine:
  hf`` starts under Ray), built here: its own copy of the policy, never sharing a tensor with the trainer (in
  ``one_step_off``/``async`` the next batch is generated in a thread while the trainer updates its weights); the
  trainer's policy reaches it only through the weight sync (:mod:`cluster.in_process.sync`, the engine's own
  receiving side). Whatever ``rollout.engine`` says, the in-process runtime samples with transformers.
- Engines are logical: ``rollout.replicas`` (then :meth:`LocalFleet.scale`) shares of the dispatch over the one
  engine. Groups go to them with :func:`cluster.loop.scheduler.assign_groups` (whole groups, by tokens in flight) and
  each engine's share is sampled in turn, so the per-engine figures (groups, tokens, busy seconds) and the idle
  fraction are those of engines that run one after the other.
- Sampling (:mod:`rollout_workers.hf.sampling`): one completion per row of a KV-cached batch, its own generator
  seeded from (request seed, sample index) as vLLM seeds ``n=G`` requests, behaviour logprobs under the rollout's
  filtered distribution, ``rollout.stop`` with vLLM's semantics; partial rollouts (continued completions, per-token
  policy versions) through the engines' shared bookkeeping (``rollout_workers.partial``).
- Requests (``contract.requests.RequestServer``, :meth:`LocalFleet.submit`): served by the engine's batching thread
  (``rollout_workers.hf.serving``), figures under ``engine-0``; a sync pauses the running batch and its requests
  continue on the new version.
- Versions: every engine's version is recorded in the loop's ledger (``check_engine`` at start, ``set_engines`` when
  the engine list changes, ``synced`` after a verified sync, ``sync_failed`` after a failed one); groups staler than
  ``rollout.max_staleness`` are refused and sampled again after a resync by the fleets' one staleness gate
  (:class:`contract.staleness.StalenessGate`; with ``recover=False`` :class:`contract.errors.RecoveryDeferred`).

Not modelled: engine faults (nothing dies in process: ``restarts`` stays 0) and the KV cache's capacity
(``kv_cache_usage`` is None).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from cluster.in_process.progress import library_progress_bars
from cluster.in_process.logical_engine import LocalEngine
from cluster.in_process.sync import LocalWeightSync
from cluster.in_process.trainer import LocalTrainer
from cluster.loop.scheduler import assign_groups
from contract.errors import RecoveryDeferred
from contract.figures import FleetFigures
from contract.goodput import PoolTime
from contract.messages import EngineLoad, GroupRequest, GroupResult, PoolGenerateStats
from contract.model_source import ModelSource
from contract.protocols import MetricSink
from contract.requests import TokenRequest, TokenResult
from contract.staleness import StalenessGate
from contract.sync_reports import SyncReport
from contract.versions import PolicyVersionLedger
from rollout_workers.hf.engine import HFEngine
from rollout_workers.hf.sampling import MAX_BATCH_ROWS

__all__ = ["LocalEngine", "LocalFleet", "NoPolicyError"]


class NoPolicyError(RuntimeError):
    """The fleet's engine holds no complete policy (a sync failed part-way): it is synced before it samples."""


class LocalFleet:
    """The rollout side in this process (:class:`contract.protocols.Fleet`); works with a :class:`LocalTrainer`.

    Args:
        spec: the validated job spec (``rollout``: replicas, group size, sampling, stop strings, length cap,
            ``max_staleness``; ``model.dtype``; ``sync``; ``train.lora``; ``seed`` for requests without a seed).
        max_batch_rows: completions decoded together at most.
        progress: False: transformers' progress bars are off while :meth:`start` loads the model
            (:func:`cluster.in_process.progress.library_progress_bars`).

    Attributes:
        figures: the current step's :class:`FleetFigures`.
        engine: the fleet's :class:`HFEngine` (after :meth:`start`).
    """

    def __init__(self, spec, max_batch_rows: int = MAX_BATCH_ROWS, *, progress: bool = True):
        self.spec = spec
        self.max_batch_rows = max_batch_rows
        self.progress = progress
        self.figures = FleetFigures()
        self.engine: HFEngine | None = None
        self._busy_s = 0.0  # engine-seconds of sampling over every generate call, accepted or not
        self.versions: PolicyVersionLedger | None = None
        self._engines: list[LocalEngine] = []
        self._sync: LocalWeightSync | None = None
        self._status: Callable[[str], None] = lambda message: None
        self._lock = threading.Lock()  # a dispatch and the weight sync never run at once
        self._interrupted_epoch = -1
        self._logged_engines = 0
        self._figures_lock = threading.Lock()  # served requests' figures arrive on the engine's thread
        self._busy_seen = 0.0  # the engine's newest busy counter (TokenResult.busy_s)

    # ---- the engine's state, read through the fleet (tests, the loop's checks) -----------------------------------
    @property
    def model(self) -> torch.nn.Module | None:
        """The engine's policy copy (None before :meth:`start` and after :meth:`shutdown`)."""
        return self.engine.model if self.engine is not None else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a completion: the model's ``generation_config`` EOS ids and the tokenizer's."""
        return self.engine.eos_ids if self.engine is not None else frozenset()

    @property
    def model_version(self) -> int | None:
        """The policy version the engine holds; None after a failed sync (it refuses to sample) or before start."""
        return self.engine.policy_version if self.engine is not None else None

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, weights_path: str, policy_version: int, trainer: LocalTrainer, versions: PolicyVersionLedger,
              status: Callable[[str], None]) -> None:
        """Build the fleet's :class:`HFEngine` from ``weights_path`` (``model.dtype``; with ``train.lora.sync:
        adapter`` the engine wraps its model with PEFT adapters from the trainer's adapter config when the sync
        forms, ``B = 0``: the base), form the weight sync with ``trainer``'s rank and record ``rollout.replicas``
        engines in ``versions`` (their versions unknown until the first sync, as the Ray shell's). A resumed LoRA
        job's fleet holds the base model until the loop syncs the checkpoint's policy.

        Raises:
            TypeError: ``trainer`` is not a :class:`LocalTrainer`.
            RuntimeError: the trainer is not started, or its rank is on a GPU (the in-process sync is gloo).
            ValueError: the trainer's sync plan does not fit the model (``HFEngine.init_weight_sync``).
            PolicyVersionError: ``policy_version`` is ahead of the trainer's (``versions.check_engine``).
        """
        if not isinstance(trainer, LocalTrainer):
            raise TypeError(f"LocalFleet works with a cluster.in_process.LocalTrainer, got {type(trainer).__name__}")
        if trainer.worker is None:
            raise RuntimeError("LocalFleet.start: the trainer is not started (call trainer.start first)")
        if trainer.info is not None and trainer.info.device != "cpu":
            raise RuntimeError(f"LocalFleet: the in-process weight sync runs over gloo, so the train rank must be on "
                               f"the CPU (train.num_gpus_per_worker 0), got device {trainer.info.device}")
        versions.check_engine(policy_version, f"the in-process fleet starting from {weights_path}")
        self.shutdown()
        self.versions, self._status = versions, status
        self._interrupted_epoch, self._busy_seen = -1, 0.0  # as a freshly started engine
        r = self.spec.rollout.model_copy(update={"cpu_affinity": None})  # never bind the calling process
        with library_progress_bars(self.progress):
            self.engine = HFEngine(weights_path, r, self.spec.model.dtype, self.spec.seed, 0, policy_version,
                                   lora=self.spec.train.lora, source=ModelSource.of(self.spec.model),
                                   max_batch_rows=self.max_batch_rows)
        self._engines = [LocalEngine(i) for i in range(self.spec.rollout.replicas)]
        self._sync = LocalWeightSync(self.spec, trainer.worker, self.engine, versions)
        versions.set_engines(self._engines)

    def check(self, model_path: str) -> None:
        """Pre-start check (starts nothing): the train rank must be on the CPU, since the in-process weight sync is a
        gloo group of two members in one process (two NCCL ranks cannot share a GPU).

        Raises:
            ModelError: ``train.num_gpus_per_worker`` > 0 while a GPU is visible.
        """
        from cluster.data.models import ModelError

        if self.spec.train.num_gpus_per_worker > 0 and torch.cuda.is_available():
            raise ModelError(f"train.num_gpus_per_worker: the in-process runtime syncs weights over gloo within one "
                             f"process, so the train rank must run on the CPU: expected 0, got "
                             f"{self.spec.train.num_gpus_per_worker}")

    @property
    def num_engines(self) -> int:
        """Logical engines serving now."""
        return len(self._engines)

    @property
    def restarts(self) -> int:
        """Engines replaced after a failure: always 0 (nothing fails apart in one process)."""
        return 0

    @property
    def sync_names(self) -> list[str]:
        """The tensors every sync streams, in plan order (HF names, or PEFT's adapter names); [] before start."""
        return list(self._sync.names) if self._sync is not None else []

    def begin_step(self, figures: FleetFigures | None = None) -> None:
        """Start a step's :attr:`figures`: afresh (the engine's busy counter as seen so far is the request window's
        base), or from a carried-over round's ``figures``."""
        with self._figures_lock:
            self.figures = figures if figures is not None else FleetFigures(engines=len(self._engines),
                                                                            busy_base={0: self._busy_seen})

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the logical engines (pool ``rollout``) and their sampling seconds so far;
        no cores of their own (they sample in the driver's process, on its cores)."""
        return [PoolTime("rollout", len(self._engines), self._busy_s)]

    def describe(self) -> str:
        """``"2 engine(s) in process, 3 sync bucket(s)"``."""
        buckets = len(self._sync.buckets) if self._sync is not None else 0
        return f"{self.num_engines} engine(s) in process, {buckets} sync bucket(s)"

    def shutdown(self) -> None:
        """Close the weight-sync group and drop the engine (idempotent)."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        if self.versions is not None and self._engines:
            self.versions.set_engines([])
        self._engines = []

    # ---- sampling -------------------------------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], on_groups: Callable[[list[GroupResult]], None] | None = None,
                 record: bool = True, recover: bool = True, interrupt_epoch: int | None = None
                 ) -> list[GroupResult]:
        """Sample one group per request (results in request order), each at a policy version within
        ``rollout.max_staleness`` of ``versions.current``; stale groups are refused, the fleet synced and the groups
        sampled again (same seeds: the same groups on the new weights). See :class:`contract.protocols.Fleet`.

        Raises:
            RuntimeError: before :meth:`start`.
            RecoveryDeferred: with ``recover=False``, the groups came back stale or the model holds no complete
                policy (a failed sync).
            StaleSamplesError: groups still stale after a resync (``contract.staleness``).
            PolicyVersionError: a group sampled at a version ahead of the trainer's.
            ValueError: a request's ``resume_from`` does not fit it (``rollout_workers.partial.completion_jobs``).
        """
        if self._sync is None:
            raise RuntimeError("LocalFleet.generate: the fleet is not started (call start first)")

        def on_fault(exc: BaseException) -> bool:  # NoPolicyError: a failed sync left a partial load
            if not recover:
                raise RecoveryDeferred(f"the fleet's model holds no complete policy after a failed sync; "
                                       f"{len(requests)} group(s) to sample again after the sync") from exc
            self._resync("a failed weight sync")
            return True

        def once():
            groups, stats = self._generate_once(requests, on_groups, interrupt_epoch)
            self._busy_s += sum(stats.engine_seconds)  # accepted or not: the engine spent it
            return groups, stats

        gate = StalenessGate(self.versions, self.spec.rollout.max_staleness, self._resync, self._status)
        return gate.run(once, figures=lambda: self.figures, record=record, recover=recover, attempts=3,
                        faults=(NoPolicyError,), on_fault=on_fault)

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Serve one request on the engine (``contract.requests.RequestServer``; thread-safe); its figures go to the
        step's :attr:`figures` under engine 0.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self.engine is None:
            raise RuntimeError("LocalFleet.submit: the fleet is not started (call start first)")
        submitted, outer = time.perf_counter(), Future()

        def settle(inner: Future) -> None:
            if inner.exception() is not None:
                outer.set_exception(inner.exception())
                return
            result = dataclasses.replace(inner.result(), engine="engine-0")
            with self._figures_lock:
                self._busy_s += max(0.0, result.busy_s - self._busy_seen)  # what it served since the newest seen
                self._busy_seen = max(self._busy_seen, result.busy_s)
                self.figures.add_request(0, result, submitted, time.perf_counter())
            outer.set_result(result)

        self.engine.submit(request).add_done_callback(settle)
        return outer

    def interrupt(self, epoch: int) -> None:
        """Stop every generate call of ``interrupt_epoch`` <= ``epoch``, running or still to come, at its next token
        step (an integer assignment: safe from any thread while a call runs)."""
        self._interrupted_epoch = max(self._interrupted_epoch, int(epoch))

    def interrupted(self, interrupt_epoch: int | None) -> bool:
        """Whether a call of ``interrupt_epoch`` must stop now (None: never); the engine checks it before every token
        step (the logical engines share the one engine, so the fleet keeps the epochs)."""
        return interrupt_epoch is not None and self._interrupted_epoch >= interrupt_epoch

    def _generate_once(self, requests: list[GroupRequest], on_groups, interrupt_epoch: int | None
                       ) -> tuple[list[GroupResult], PoolGenerateStats]:
        """One dispatch of ``requests`` over the logical engines (``assign_groups``), each engine's share sampled in
        turn; ``on_groups`` gets each share's groups as it finishes. Returns (groups in request order, the call's
        stats as ``RolloutPool.generate`` reports them)."""
        r = self.spec.rollout
        t0 = time.perf_counter()
        plan = assign_groups([len(q.prompt_ids) for q in requests], [q.group_size or r.group_size for q in requests],
                             len(self._engines), r.max_response_tokens)
        per_engine = [EngineLoad(groups=len(idx)) for idx in plan]
        by_id: dict[int, GroupResult] = {}
        busy: list[float] = []
        for k, idx in enumerate(plan):
            if not idx:
                continue
            t = time.perf_counter()
            results = self._sample([requests[i] for i in idx], interrupt_epoch)
            seconds = time.perf_counter() - t
            new_tokens = sum(len(ids) for g in results for ids in g.response_ids) - _prior_tokens(
                [requests[i] for i in idx])
            per_engine[k] = EngineLoad(groups=len(idx), tokens=new_tokens, seconds=seconds)
            busy.append(seconds)
            by_id.update((g.group_id, g) for g in results)
            if on_groups is not None:
                on_groups(results)
        wall = time.perf_counter() - t0
        idle = min(1.0, max(0.0, 1.0 - sum(busy) / (len(self._engines) * wall))) if wall > 0 else 0.0
        return [by_id[q.group_id] for q in requests], PoolGenerateStats(
            tokens=sum(e.tokens for e in per_engine), engine_seconds=busy, engine_idle_fraction=idle,
            per_engine=per_engine, capacity_seconds=len(self._engines) * wall)

    def _sample(self, requests: list[GroupRequest], interrupt_epoch: int | None) -> list[GroupResult]:
        """One logical engine's share on the engine (``HFEngine.generate``), under the fleet's lock.

        Raises:
            NoPolicyError: the engine holds no complete policy after a failed weight sync.
        """
        with self._lock:
            if self.model_version is None:
                raise NoPolicyError("the fleet's model holds no complete policy after a failed weight sync")
            return self.engine.generate(requests, self.spec.rollout.group_size, interrupt_epoch,
                                        interrupted=lambda: self.interrupted(interrupt_epoch))[0]

    # ---- weights and engines --------------------------------------------------------------------------------------
    def sync_policy(self) -> SyncReport:
        """Stream the trainer's policy (``versions.current``) into the model through the weight-sync path, verify
        it (``sync.verify``) and record every engine at that version (:meth:`LocalWeightSync.sync`).

        Raises:
            RuntimeError: before :meth:`start`; a transport failure. SyncVerificationError, PolicyVersionError: see
                :meth:`LocalWeightSync.sync`. After a failure the model refuses to sample until a sync succeeds.
        """
        if self._sync is None:
            raise RuntimeError("LocalFleet.sync_policy: the fleet is not started")
        with self._lock:
            try:
                report = self._sync.sync(len(self._engines))
            except BaseException:
                self.engine.refuse_until_synced()  # perhaps received but not verified
                raise
        return report

    def _resync(self, why: str) -> None:
        """Sync every engine; with ``sync.verify`` on, an unverified sync is an error naming ``why``."""
        report = self.sync_policy()
        if self.spec.sync.verify and not report.verified:
            raise RuntimeError(f"weight sync after {why} was not verified")

    def scale(self, replicas: int) -> None:
        """Resize to ``replicas`` logical engines between steps; the engine list in the ledger changes and every
        engine is synced before it serves (as ``EngineFleet.scale``).

        Raises:
            ValueError: ``replicas`` < 1.
        """
        if replicas < 1:
            raise ValueError(f"rollout replicas must be >= 1, got {replicas}")
        have = len(self._engines)
        if replicas == have:
            return
        self._engines = self._engines[:replicas] + [LocalEngine(i) for i in range(have, replicas)]
        self.versions.set_engines(self._engines)
        self._resync(f"rollout pool scaled {have} -> {replicas}")
        self._status(f"rollout pool scaled from {have} to {replicas} engine(s) at policy version "
                     f"{self.versions.current}")

    def log_workers(self, sink: MetricSink, step: int, figures: FleetFigures | None = None) -> None:
        """Per-engine figures of the step (``figures``, default :attr:`figures`) to ``sink.log_worker`` (pool
        ``rollout``, worker ``engine-<i>``), the keys ``EngineFleet.log_workers`` writes; series of engines removed
        by a scale-down are dropped."""
        figures = figures if figures is not None else self.figures
        idle = EngineLoad(groups=0)
        for i in range(len(self._engines)):
            e = figures.per_engine.get(i, idle)
            sink.log_worker(step, "rollout", f"engine-{i}", {
                "policy_version": float(self.versions.current),
                "perf/rollout_tokens_per_s": e.tokens / e.seconds if e.seconds > 0 else 0.0,
                "rollout/queue_depth": float(e.groups),
                "rollout/engine_busy_s": e.seconds,
                "rollout/kv_cache_usage": float(e.kv_cache_usage or 0.0),
                "workers/restarts": float(self.restarts),
            })
        for i in range(len(self._engines), self._logged_engines):
            sink.remove_worker("rollout", f"engine-{i}")
        self._logged_engines = len(self._engines)


def _prior_tokens(requests: list[GroupRequest]) -> int:
    """Tokens the requests' ``resume_from`` groups already had (not sampled by this call)."""
    return sum(len(ids) for q in requests if q.resume_from is not None for ids in q.resume_from.response_ids)
