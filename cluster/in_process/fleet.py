"""The in-process rollout side: :class:`LocalFleet` samples groups with transformers in the calling process.

It implements :class:`contract.protocols.Fleet` with the semantics of the Ray shell's fleet
(``cluster.ray_shell.fleet.EngineFleet`` over vLLM engines, ``rollout_workers.engine.RolloutEngine``):

- Its own copy of the policy: an HF model loaded from the weights it starts from, never sharing a tensor with the
  trainer (in ``one_step_off``/``async`` the next batch is generated in a thread while the trainer updates its
  weights); the trainer's policy reaches it only through the weight sync (:mod:`cluster.in_process.sync`).
- Engines are logical: ``rollout.replicas`` (then :meth:`LocalFleet.scale`) shares of the dispatch over the one
  model. Groups go to them with :func:`cluster.loop.scheduler.assign_groups` (whole groups, by tokens in flight) and
  each engine's share is sampled in turn, so the per-engine figures (groups, tokens, busy seconds) and the idle
  fraction are those of engines that run one after the other.
- Sampling (:mod:`cluster.in_process.sampling`): one completion per row of a KV-cached batch, its own generator
  seeded from (request seed, sample index) as vLLM seeds ``n=G`` requests, behaviour logprobs under the rollout's
  filtered distribution. A completion's request jobs and its group's assembly (partial rollouts: continued
  completions, per-token policy versions) are ``rollout_workers.partial``'s, the engine's own bookkeeping.
- Versions: every engine's version is recorded in the loop's ledger (``check_engine`` at start, ``set_engines`` when
  the engine list changes, ``synced`` after a verified sync, ``sync_failed`` after a failed one); groups staler than
  ``rollout.max_staleness`` are refused and sampled again after a resync (or, with ``recover=False``, raise
  :class:`contract.errors.RecoveryDeferred`).

Not modelled: engine faults (nothing dies in process: ``restarts`` stays 0) and the KV cache's capacity
(``kv_cache_usage`` is None).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import torch

from cluster.in_process.sampling import MAX_BATCH_ROWS, request_sampling, sample_groups
from cluster.in_process.sync import LocalWeightSync, peft_bound_modules, sync_targets
from cluster.in_process.trainer import LocalTrainer
from cluster.loop.scheduler import assign_groups
from contract.model_source import ModelSource
from contract.errors import RecoveryDeferred
from contract.figures import FleetFigures
from contract.messages import EngineLoad, GroupRequest, GroupResult, PoolGenerateStats, SyncReport
from contract.protocols import MetricSink
from contract.versions import PolicyVersionLedger
from grpo.eos import eos_token_ids

__all__ = ["LocalEngine", "LocalFleet", "StaleSamplesError", "load_policy_model", "request_sampling"]


class StaleSamplesError(RuntimeError):
    """Groups kept coming back older than ``rollout.max_staleness`` after the fleet was synced again."""


class LocalEngine:
    """One logical engine of a :class:`LocalFleet`: a share of the dispatch over the fleet's one model, and the handle
    the ledger records a version for.

    Attributes:
        index: its position in the fleet (``engine-<index>`` in the per-engine figures).
    """

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"LocalEngine({self.index})"


class LocalFleet:
    """The rollout side in this process (:class:`contract.protocols.Fleet`); works with a :class:`LocalTrainer`.

    Args:
        spec: the validated job spec (``rollout``: replicas, group size, sampling, length cap, ``max_staleness``;
            ``model.dtype``; ``sync``; ``train.lora``; ``seed`` for requests without a seed).
        max_batch_rows: completions decoded together at most.

    Attributes:
        figures: the current step's :class:`FleetFigures`.
        model: the fleet's own policy copy (after :meth:`start`). tokenizer: its tokenizer.
        model_version: the policy version the model holds; None after a failed sync (it refuses to sample).
        eos_ids: the ids that end a completion: the model's ``generation_config`` EOS ids and the tokenizer's.
    """

    def __init__(self, spec, max_batch_rows: int = MAX_BATCH_ROWS):
        self.spec, self.max_batch_rows = spec, max_batch_rows
        self.figures = FleetFigures()
        self.model = self.tokenizer = None
        self.model_version: int | None = None
        self.versions: PolicyVersionLedger | None = None
        self._engines: list[LocalEngine] = []
        self._sync: LocalWeightSync | None = None
        self._status: Callable[[str], None] = lambda message: None
        self.eos_ids: frozenset[int] = frozenset()
        self._lock = threading.Lock()  # generate and the weight sync never run at once
        self._interrupted_epoch = -1
        self._unseeded = random.Random(spec.seed)  # seeds of requests that carry none
        self._logged_engines = 0

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, weights_path: str, policy_version: int, trainer: LocalTrainer, versions: PolicyVersionLedger,
              status: Callable[[str], None]) -> None:
        """Load the fleet's own copy of the policy from ``weights_path`` (``model.dtype``; with ``train.lora.sync:
        adapter`` wrapped with PEFT adapters from the trainer's adapter config, ``B = 0``: the base), form the weight
        sync with ``trainer``'s rank and record ``rollout.replicas`` engines in ``versions`` (their versions unknown
        until the first sync, as the Ray shell's). A resumed LoRA job's fleet holds the base model until the loop
        syncs the checkpoint's policy.

        Raises:
            TypeError: ``trainer`` is not a :class:`LocalTrainer`.
            RuntimeError: the trainer is not started, or its rank is on a GPU (the in-process sync is gloo).
            ValueError: the trainer's sync plan does not fit the model (:class:`LocalWeightSync`).
            PolicyVersionError: ``policy_version`` is ahead of the trainer's (``versions.check_engine``).
        """
        if not isinstance(trainer, LocalTrainer):
            raise TypeError(f"LocalFleet works with a cluster.in_process.LocalTrainer, got {type(trainer).__name__}")
        if trainer.worker is None:
            raise RuntimeError("LocalFleet.start: the trainer is not started (call trainer.start first)")
        if trainer.info is not None and trainer.info.device != "cpu":
            raise RuntimeError(f"LocalFleet: the in-process weight sync runs over gloo, so the train rank must be on "
                               f"the CPU (train.num_gpus_per_worker 0), got device {trainer.info.device}")
        from transformers import AutoTokenizer

        versions.check_engine(policy_version, f"the in-process fleet starting from {weights_path}")
        self.shutdown()
        self.versions, self._status = versions, status
        self._interrupted_epoch = -1  # as a freshly started engine
        adapter_config = trainer.worker.sync_adapter_config()
        source = ModelSource.of(self.spec.model)
        self.tokenizer = AutoTokenizer.from_pretrained(weights_path, **source.hf_kwargs(weights_path))
        self.model = load_policy_model(weights_path, self.spec, adapter_config)
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = eos_token_ids(config_eos, self.tokenizer.eos_token_id)
        self.model_version = policy_version
        self._engines = [LocalEngine(i) for i in range(self.spec.rollout.replicas)]
        adapter = adapter_config is not None
        self._sync = LocalWeightSync(self.spec, trainer.worker, sync_targets(self.model, adapter), versions,
                                     bound_modules=(lambda: peft_bound_modules(self.model)) if adapter else None)
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

    def begin_step(self) -> None:
        """Start a step's :attr:`figures` afresh."""
        self.figures = FleetFigures()

    def describe(self) -> str:
        """``"2 engine(s) in process, 3 sync bucket(s)"``."""
        buckets = len(self._sync.buckets) if self._sync is not None else 0
        return f"{self.num_engines} engine(s) in process, {buckets} sync bucket(s)"

    def shutdown(self) -> None:
        """Close the weight-sync group and drop the model (idempotent)."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
        if self.versions is not None and self._engines:
            self.versions.set_engines([])
        self._engines, self.model, self.model_version = [], None, None

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
            StaleSamplesError: groups still stale after a resync.
            PolicyVersionError: a group sampled at a version ahead of the trainer's.
            ValueError: a request's ``resume_from`` does not fit it (``rollout_workers.partial.completion_jobs``).
        """
        if self._sync is None:
            raise RuntimeError("LocalFleet.generate: the fleet is not started (call start first)")
        max_staleness = self.spec.rollout.max_staleness
        for _ in range(3):
            if self.model_version is None:  # a failed sync left a partial load
                if not recover:
                    raise RecoveryDeferred(f"the fleet's model holds no complete policy after a failed sync; "
                                           f"{len(requests)} group(s) to sample again after the sync")
                self._resync("a failed weight sync")
            groups, stats = self._generate_once(requests, on_groups, interrupt_epoch)
            stale = [g for g in groups if self.versions.staleness(g.policy_version) > max_staleness]
            if not stale:
                if record:
                    self.figures.add(stats)
                return groups
            if not recover:
                raise RecoveryDeferred(f"{len(stale)} stale group(s) during a generate that overlaps training")
            self._status(f"{len(stale)} group(s) sampled at policy version {min(g.policy_version for g in stale)} "
                         f"(trainer {self.versions.current}, rollout.max_staleness={max_staleness}); re-syncing and "
                         f"sampling again")
            self.figures.stale_refused += len(stale)
            self._resync("stale samples")
        raise StaleSamplesError(f"the in-process fleet still returned stale groups after 3 attempts (model at policy "
                                f"version {self.model_version}, trainer at {self.versions.current})")

    def interrupt(self, epoch: int) -> None:
        """Stop every generate call of ``interrupt_epoch`` <= ``epoch``, running or still to come, at its next token
        step (an integer assignment: safe from any thread while a call runs)."""
        self._interrupted_epoch = max(self._interrupted_epoch, int(epoch))

    def interrupted(self, interrupt_epoch: int | None) -> bool:
        """Whether a call of ``interrupt_epoch`` must stop now (None: never); checked before every token step."""
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
            per_engine=per_engine)

    def _sample(self, requests: list[GroupRequest], interrupt_epoch: int | None) -> list[GroupResult]:
        """Sample ``requests``' completions on the model (one engine's share), under the lock: every completion
        of every group (or, resuming, only the interrupted ones, from their tokens), assembled as the engine does."""
        with self._lock:
            version = self.model_version
            if version is None:
                raise RuntimeError("the fleet's model holds no complete policy after a failed weight sync")
            return sample_groups(self.model, self.tokenizer, self.eos_ids, requests, self.spec.rollout, version,
                                 lambda: self._unseeded.getrandbits(63), lambda: self.interrupted(interrupt_epoch),
                                 self.max_batch_rows)

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
            self.model_version = None  # a partial load until the sync is verified
            report = self._sync.sync(len(self._engines))
            self.model_version = report.policy_version
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


def load_policy_model(weights_path: str, spec, adapter_config: dict | None = None) -> torch.nn.Module:
    """The fleet's policy copy: ``weights_path`` in ``model.dtype``, on a GPU when ``rollout.num_gpus_per_replica``
    > 0 and one is visible, in eval mode without gradients; with ``adapter_config`` (``train.lora.sync: adapter``)
    wrapped by PEFT with that config (adapters at their ``B = 0`` start: the base model)."""
    from transformers import AutoModelForCausalLM

    from train_workers.sharding import as_dtype

    on_gpu = torch.cuda.is_available() and spec.rollout.num_gpus_per_replica > 0
    model = AutoModelForCausalLM.from_pretrained(weights_path, dtype=as_dtype(spec.model.dtype),
                                                 **ModelSource.of(spec.model).hf_kwargs(weights_path))
    if adapter_config is not None:
        from peft import get_peft_config, get_peft_model

        model = get_peft_model(model, get_peft_config(dict(adapter_config)))
    model.to(torch.device("cuda") if on_gpu else torch.device("cpu"))
    model.eval()
    model.requires_grad_(False)
    return model
