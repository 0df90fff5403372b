"""The role protocols the loop is written against: the rollout side (:class:`Fleet`), the train side
(:class:`Trainer`), the reward functions' workers (:class:`RewardPool`), the job's control channel
(:class:`ControlChannel`) and a metrics sink (:class:`MetricSink`).

:class:`cluster.driver.GRPOJob` receives one of each (the reward pool and the control channel are optional) and calls
nothing else: the
Ray shell (``cluster.ray_shell``: vLLM engine actors, FSDP2/Megatron train ranks, streamed weight sync) and the
in-process runtime (``cluster.in_process``: transformers generation and one train rank in the calling process)
implement them. One train rank's own protocol is :class:`contract.train_worker.TrainWorker`.

Lifecycle: a job builds its collaborators unstarted, then :meth:`Trainer.start` builds the train side from the model
(or a checkpoint) and :meth:`Fleet.start` starts the engines and joins them to the trainer's weight sync. A guard
rollback or a resume shuts both down and starts them again from a checkpoint.

Notation: B prompts, G completions per prompt, W train ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from contract.batches import PackedMicroBatch
from contract.figures import FleetFigures
from contract.messages import GroupRequest, GroupResult, TrainResult
from contract.rewards import RewardCall, RewardScores, RewardTicket
from contract.sync_reports import SyncReport
from contract.train_worker import TrainWorker
from contract.versions import PolicyVersionLedger

__all__ = ["ControlChannel", "Fleet", "MetricSink", "RewardPool", "Trainer", "TrainWorker"]


@runtime_checkable
class Trainer(Protocol):
    """The train side: W ranks holding the policy, the frozen reference policy and the optimizer.

    Attributes:
        world_size: W, the ranks the scheduler balances a batch over (``train_step`` takes one list per rank).
        num_parameters: of the policy (valid after :meth:`start`).
    """

    world_size: int
    num_parameters: int

    def check(self, model_path: str) -> None:
        """Pre-start checks of the spec's train settings against the model (LoRA targets, model-parallel layout);
        starts nothing, so ``grpo-cluster validate`` runs them too.

        Raises:
            ModelError (a ValueError): naming the spec field.
        """
        ...

    def start(self, model_path: str, policy_path: str | None = None) -> None:
        """Build the ranks: the policy from ``policy_path`` (a checkpoint's policy folder, on resume) or
        ``model_path``; the reference policy always from ``model_path``.

        Raises:
            RuntimeError (or a runtime's failure type): a rank could not be built; nothing stays running.
        """
        ...

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps on every rank (adaptive KL controller)."""
        ...

    def set_lr(self, lr: float) -> None:
        """Set the learning rate for the following train steps on every rank (``train.lr_schedule``; the loop
        calls it before each step when the rate changes over the run)."""
        ...

    def train_step(self, per_rank: list[list[PackedMicroBatch]], num_tokens: int, num_sequences: int
                   ) -> TrainResult:
        """One policy update: rank r trains ``per_rank[r]`` (W lists of micro-batches).

        Args:
            num_tokens, num_sequences: loss tokens, and sequences with at least one, over the whole batch.

        Returns:
            the step's :class:`TrainResult` (policy version after the step, skipped or not and why, ``kl``, metrics).
        """
        ...

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        """Every rank writes its part (policy folder, optimizer state) into ``folder``; ``checkpoint`` names the
        final checkpoint in errors (the loop writes into a temporary folder that is renamed)."""
        ...

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Load the optimizer state of checkpoint ``path`` and continue at ``policy_version``; returns
        ``{field: (saved, in use)}`` for optimizer fields the spec changed."""
        ...

    def describe(self) -> str:
        """One status phrase, e.g. ``"2 train rank(s), 134.5M parameters"``."""
        ...

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        ...


@runtime_checkable
class Fleet(Protocol):
    """The rollout side: engines that sample groups with behaviour logprobs, receive the trainer's policy, and scale.

    Attributes:
        figures: the current step's figures (tokens, idle fraction, per-engine load); started by :meth:`begin_step`,
            added to by every recorded generate call.
    """

    figures: FleetFigures

    def check(self, model_path: str) -> None:
        """Pre-start checks of the spec's rollout settings against the model (e.g. whether the engine serves LoRA
        adapters for its architecture); starts nothing.

        Raises:
            ModelError (a ValueError): naming the spec field.
        """
        ...

    def start(self, weights_path: str, policy_version: int, trainer: Trainer, versions: PolicyVersionLedger,
              status: Callable[[str], None]) -> None:
        """Start the engines holding ``weights_path``'s weights (policy version ``policy_version``) and join them to
        ``trainer``'s weight sync; every engine's version is reported to ``versions`` (the ledger the loop owns).
        A fleet works with its own runtime's trainer.

        Raises:
            TypeError: ``trainer`` is not of this fleet's runtime. The runtime's start-up failures.
        """
        ...

    @property
    def num_engines(self) -> int:
        """Engines serving now."""
        ...

    @property
    def restarts(self) -> int:
        """Engines replaced after a failure so far."""
        ...

    def begin_step(self, figures: FleetFigures | None = None) -> None:
        """Start a step's :attr:`figures`: afresh, or from ``figures`` (those of a partial round carried over from
        an interrupted call, whose groups the step goes on with)."""
        ...

    def generate(self, requests: list[GroupRequest], on_groups: Callable[[list[GroupResult]], None] | None = None,
                 record: bool = True, recover: bool = True, interrupt_epoch: int | None = None
                 ) -> list[GroupResult]:
        """Sample one group per request (results in request order), each group at a policy version within
        ``rollout.max_staleness`` of the trainer's (``versions.current``).

        Args:
            on_groups: called with each batch of finished groups as they arrive (scoring while others sample).
            record: add the call's figures to :attr:`figures` (held-out evaluation passes False).
            recover: may replace and re-sync engines after a fault. False while a train step runs (one_step_off,
                async): a fault then raises :class:`contract.errors.RecoveryDeferred`.
            interrupt_epoch: (partial rollouts) :meth:`interrupt` with an epoch >= it stops the call early; groups
                with an ``"interrupted"`` completion come back as they are.
        """
        ...

    def interrupt(self, epoch: int) -> None:
        """Stop every generate call of ``interrupt_epoch`` <= ``epoch`` at its next engine step."""
        ...

    def sync_policy(self) -> SyncReport:
        """Send the trainer's current policy (``versions.current``) to every engine and verify what they received
        (``sync.verify``); returns the sync's report (``.metrics()``: the ``sync/*`` metrics)."""
        ...

    def scale(self, replicas: int) -> None:
        """Resize to ``replicas`` engines between steps; new engines receive the current policy before they serve.

        Raises:
            ValueError: ``replicas`` < 1.
        """
        ...

    def log_workers(self, sink: MetricSink, step: int, figures: FleetFigures | None = None) -> None:
        """Per-engine figures of the step (``figures``: those of the batch the step trained on; None:
        :attr:`figures`) to ``sink.log_worker`` (pool ``rollout``)."""
        ...

    def describe(self) -> str:
        """One status phrase, e.g. ``"1 engine(s), 13 sync bucket(s)"``."""
        ...

    def shutdown(self) -> None:
        """Stop every engine (idempotent)."""
        ...


@runtime_checkable
class RewardPool(Protocol):
    """Where the reward functions run: in the driver (inline), or on workers (Ray actors, local processes) so that
    the loop never blocks on a slow verifier and one engine's groups are scored while the others still sample.

    The loop submits each engine's groups as they arrive (:meth:`submit`, never blocking on a reward function of a
    remote pool) and collects the round's scores before it computes advantages (:meth:`collect`). Scores are per
    completion, so how a pool batches calls does not change them; a call the pool loses (its worker died or timed
    out) gets no score: its rows are infrastructure failures (NaN), never zeros.

    Attributes:
        workers: reward workers serving (0: the reward functions run in the calling thread at :meth:`submit`).
    """

    workers: int

    def start(self) -> None:
        """Start the workers with every reward function of the job loaded (idempotent).

        Raises:
            RuntimeError (a RewardError, or a runtime's failure type): a worker could not start or load a reward
                function; the message names the function and where it is defined.
        """
        ...

    def submit(self, calls: Sequence[RewardCall]) -> RewardTicket:
        """Queue ``calls`` to be scored and return at once (an inline pool scores them here)."""
        ...

    def collect(self, ticket: RewardTicket, timeout_s: float) -> list[RewardScores]:
        """The scores of ``ticket``'s calls, in submission order, waiting at most ``timeout_s`` seconds; calls not
        scored by then get no score (their rows are infrastructure failures).

        Raises:
            RewardError (``grpo.rewards.calling``): a reward function broke its contract (wrong count, non-numbers),
                or raised with ``on_error="raise"``; the message names it and where it is defined.
        """
        ...

    def metrics(self) -> dict[str, float]:
        """The pool's ``reward_pool/*`` figures so far (cumulative counts); {} for an inline pool."""
        ...

    def describe(self) -> str:
        """One status phrase, e.g. ``"2 reward worker(s) (Ray actors, 64 completions per call, 60 s timeout)"``."""
        ...

    def shutdown(self) -> None:
        """Stop every worker (idempotent); calls not collected yet get no score."""
        ...


@runtime_checkable
class ControlChannel(Protocol):
    """How an operator steers a running job (``grpo-cluster scale``, ``status``): read between steps."""

    def desired_rollout_replicas(self) -> int | None:
        """The engine count asked for (None: no request)."""
        ...

    def report(self, status: Mapping[str, Any]) -> None:
        """Publish the job's state (step, policy version, engines, ...)."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class MetricSink(Protocol):
    """Where a job's metrics go (``metrics.jsonl`` and Prometheus: ``cluster.sinks.metrics.MetricsLogger``).

    A sink may also take the step's sample records (plain JSON data, ``cluster.loop.samples``) with a method
    ``log_samples(step, records)`` (``samples.jsonl``: ``cluster.sinks.samples.SampleLog``; the trackers' tables);
    the job calls it on the sinks that have it.

    Attributes:
        url: the Prometheus endpoint's address, None without one.
    """

    url: str | None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The step's driver-level row."""
        ...

    def log_worker(self, step: int, pool: str, worker: str, metrics: Mapping[str, Any]) -> None:
        """One worker's figures of the step (labelled series, ``workers.jsonl``)."""
        ...

    def remove_worker(self, pool: str, worker: str) -> int:
        """Drop a worker's series (it left the pool)."""
        ...

    def reopen(self) -> None:
        """Reopen the step logs after they were truncated (resume, rollback)."""
        ...

    def close(self) -> None:
        ...
