"""The train stage seen from the loop: pack the batch into per-rank micro-batches, set the step's learning rate
(``train.lr_schedule``), take one policy update on the trainer, feed the KL controller, count updates skipped for
NaN/Inf, and send the new policy to the fleet (with LoRA: check that an adapter payload moves with the policy, and
warn when a merged sync's rounding swallows the update).

:class:`TrainPhase` is what the rollout schedule calls as its ``train`` and ``sync`` phases; it talks to the trainer
and the fleet through their protocols (``contract.protocols.Trainer``/``Fleet``) and to the policy-version ledger.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cluster.loop.goodput import DriverClock
from cluster.loop.lr_schedule import LRSchedule
from cluster.loop.samples import sample_rows, traced_mask
from cluster.loop.scheduler import plan_microbatches
from cluster.loop.step_metrics import StepBatch, StepClock
from contract.batches import RolloutBatch
from contract.messages import TrainResult
from contract.protocols import Fleet, Trainer
from contract.sync_reports import SyncReport
from contract.versions import PolicyVersionLedger
from train_workers.packing import pack_rank_microbatches
from weight_sync.verify import AdapterSyncError


#: ``sync/merge_update_error`` above which the loop warns (once per job) that a merged LoRA sync loses the update
#: to the engine dtype's rounding: above 0.25, more than a quarter of the update's norm is lost or replaced by
#: rounding error (``SendReport.merge_update_error``; measured in docs/results.md, "LoRA merged sync in bfloat16").
MERGE_ROUNDING_BOUND = 0.25


class NumericsError(RuntimeError):
    """``train.max_skipped_updates`` updates in a row had a NaN/Inf loss or gradient."""


def microbatches(batch: RolloutBatch, train, world_size: int | None = None,
                 traced: set[int] = frozenset()) -> tuple[list, dict]:
    """Balance the batch's N sequences over ``world_size`` ranks (default ``train.world_size``; the trainer's own
    rank count, e.g. 1 in the in-process runtime) and pack each rank's micro-batches under
    ``train.max_tokens_per_microbatch`` tokens (prompt + response; a multi-turn episode's response holds its
    observation tokens, which are packed and run forward but masked out of the loss). The rows in ``traced`` (the
    step's samples) are marked for their per-token trainer logprobs (``PackedMicroBatch.traced``).

    Returns:
        (per rank: its packed micro-batches, the plan's ``packing/*`` metrics).
    """
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    plan = plan_microbatches(lengths, world_size or train.world_size, train.max_tokens_per_microbatch,
                             oversize=train.oversize_sequences)
    per_rank = pack_rank_microbatches(plan.ranks, batch.prompt_ids, batch.response_ids, batch.advantages,
                                      batch.behaviour_logprobs, batch.valid_lengths, group_ids=batch.group_ids,
                                      loss_masks=batch.loss_masks)
    if traced:
        for mb in (mb for rank in per_rank for mb in rank):
            mb.traced = traced_mask(mb.seq_indices, traced)
    return per_rank, plan.stats(lengths)


def save_train_state(train: Trainer, folder: str, checkpoint: str) -> None:
    """Every rank writes its part of a checkpoint (HF policy folder, sharded optimizer) into ``folder``, the
    temporary folder of ``checkpoint`` (named in errors)."""
    train.save_checkpoint(folder, checkpoint)


def load_train_state(train: Trainer, checkpoint: str, policy_version: int) -> dict[str, tuple]:
    """Every rank loads its optimizer state from ``checkpoint`` at ``policy_version``.

    Returns:
        optimizer field → (saved value, value in use) for fields the spec changed since the checkpoint.
    """
    return train.load_checkpoint(checkpoint, policy_version)


class SkippedUpdates:
    """Counts updates skipped for NaN/Inf: steps in a row with a skipped update (reset by a step without one) and
    optimizer updates skipped in total (``actor/updates_skipped_total``: with ``algorithm.num_iterations`` > 1 a step
    may skip several).

    Args:
        limit: ``train.max_skipped_updates``; that many steps in a row stop the job.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.total = 0

    def reset(self) -> None:
        """A good update: the run of skipped ones ends."""
        self.in_a_row = 0

    def note(self, reason: str, step: int, policy_version: int, status: Callable[[str], None],
             updates: int = 1) -> None:
        """Count a step's skipped update(s) (``reason``: the non-finite metric, or ``""``; ``updates``: how many of
        its optimizer updates were skipped) and say so on ``status``.

        Raises:
            NumericsError: ``limit`` steps in a row skipped an update (naming the step, the metric and the last good
                policy version).
        """
        self.in_a_row += 1
        self.total += max(int(updates), 1)
        metric = reason or "loss or grad_norm"
        status(f"step {step}: non-finite {metric}; update skipped, weights not broadcast "
               f"({self.in_a_row} in a row, limit {self.limit})")
        if self.in_a_row >= self.limit:
            raise NumericsError(f"step {step}: {self.in_a_row} updates in a row skipped for a non-finite "
                                f"{metric} (train.max_skipped_updates={self.limit}); last good policy version "
                                f"{policy_version}")

    def state_dict(self) -> dict:
        return {"skipped_updates": self.in_a_row, "skipped_updates_total": self.total}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (absent keys: 0, for checkpoints written before the counts were kept)."""
        self.in_a_row = int(state.get("skipped_updates", 0))
        self.total = int(state.get("skipped_updates_total", 0))


@dataclass
class Trained:
    """The train phase's outcome: the trainer's :class:`TrainResult`, the micro-batch plan's ``packing/*`` metrics,
    the policy version the step trained from and the loss tokens the update learned from (0 when it was skipped)."""

    result: TrainResult
    packing: dict
    version_at_train: int
    trained_tokens: int = 0


class TrainPhase:
    """One step's train and sync phases (the rollout schedule's ``train`` and ``sync``).

    Args:
        spec: the job spec (``train`` packing settings, ``algorithm.kl_controller``).
        kl_controller: β's controller (``grpo.kl``): fixed, or adaptive (fed each good step's ``TrainResult.kl``).
        skips: counts updates skipped for NaN/Inf (stops the job after ``train.max_skipped_updates`` in a row).
        versions: the policy-version ledger (the trainer reports each step's version to it).
        status: one-line progress messages.
        current_step: the job's running step (the learning rate is the schedule's at it); None: the batch's step.
        trainer, fleet: the job's train and rollout sides (started by the job before the first step); None only for
            a job that checks its inputs and never runs (``dry_run``).
        driver_clock: counts the driver's waits on the train step and the weight sync (``cluster.loop.goodput``);
            None: a clock of its own, read by nobody.

        before_update: called first thing in :meth:`train`, before the trainer is touched (the job's preemption:
            from here a SIGTERM finishes the step instead of abandoning it); None: nothing.

    Attributes:
        lr_schedule: the job's :class:`~cluster.loop.lr_schedule.LRSchedule`.
        clock: the running step's clock (its ``train`` and ``sync`` phases are measured here), new at each
            :meth:`begin_step`.
    """

    def __init__(self, spec, kl_controller, skips: SkippedUpdates, versions: PolicyVersionLedger,
                 status: Callable[[str], None], current_step: Callable[[], int] | None = None, *,
                 trainer: Trainer | None, fleet: Fleet | None, driver_clock: DriverClock | None = None,
                 before_update: Callable[[], None] | None = None):
        self.spec, self.kl_controller, self.skips, self.versions, self._status = (spec, kl_controller, skips,
                                                                                 versions, status)
        self.lr_schedule = LRSchedule.from_spec(spec.train, spec.total_steps)
        self._current_step = current_step
        self.trainer, self.fleet = trainer, fleet
        self.driver_clock = driver_clock if driver_clock is not None else DriverClock()
        self.clock = StepClock()
        self.before_update = before_update
        self._adapter_payload: tuple[int, int] | None = None  # (policy version, CRC-32) of the last adapter sync
        self._rounding_warned = False

    def begin_step(self, bar=None) -> StepClock:
        """A new step: a new :attr:`clock` (naming the phase on ``bar``, a tqdm bar, when given), returned for the
        phases measured elsewhere (generate, score)."""
        self.clock = StepClock(bar)
        return self.clock

    def train(self, batch: StepBatch) -> Trained:
        """One policy update on ``batch``'s trained rows (β from the KL controller, the learning rate from the
        schedule at the running step). A skipped update (NaN/Inf) is counted; a good one feeds the KL controller.

        Raises:
            NumericsError: ``train.max_skipped_updates`` updates in a row were skipped.
        """
        if self.before_update is not None:
            self.before_update()
        version_at_train = self.versions.current
        rows = batch.sampling.batch
        with self.clock.phase("train"):
            traced = set(sample_rows(rows, self.spec.metrics.samples_per_step))  # the step's samples (samples.jsonl)
            per_rank, packing = microbatches(rows, self.spec.train, self.trainer.world_size, traced)
            counts = rows.loss_token_counts()  # valid_lengths, less a multi-turn episode's observation tokens
            num_tokens = sum(counts)
            num_sequences = sum(v > 0 for v in counts)
            if self.spec.algorithm.kl_controller == "adaptive":
                self.trainer.set_kl_coef(self.kl_controller.value)
            if self.lr_schedule.varies:
                step = self._current_step() if self._current_step is not None else batch.step
                self.trainer.set_lr(self.lr_schedule.lr(step))
            with self.driver_clock.waiting():
                result = self.trainer.train_step(per_rank, num_tokens, num_sequences)
            if result.skipped:
                iterations = self.spec.algorithm.num_iterations
                skipped = round(result.metrics.get("actor/update_skipped", 1.0) * iterations)  # a fraction of them
                self.skips.note(result.skip_reason, batch.step, version_at_train, self._status, updates=skipped)
            else:
                self.skips.reset()
                if result.kl is not None:  # the KL of the sequences that trained: a row masked whole is no sample
                    self.kl_controller.update(result.kl, num_sequences)
        return Trained(result, packing, version_at_train, 0 if result.skipped else num_tokens)

    def sync(self, trained: Trained) -> dict:
        """Report the trainer's version to the ledger (``PolicyVersionError`` if it went backwards or skipped one)
        and send the new policy to every engine; a skipped update changes no weights, so nothing is sent. Then the
        LoRA checks (:meth:`_check_lora_sync`). Returns the ``sync/*`` metrics.

        Raises:
            AdapterSyncError: (``train.lora.sync: adapter``) the adapter payload did not change after an update.
        """
        with self.clock.phase("sync"):
            if not self.versions.trained(trained.result.policy_version):
                return {"sync/skipped": 1.0}
            with self.driver_clock.waiting():
                report = self.fleet.sync_policy()
            self._check_lora_sync(trained.result, report)
            return {**report.metrics(), "sync/skipped": 0.0}

    def _check_lora_sync(self, result: TrainResult, report: SyncReport) -> None:
        """After a sync: with adapter sync, the payload's checksum must differ from the previous version's when the
        step applied an update with a non-zero gradient (a frozen adapter — parameters the optimizer does not move,
        or not the ones streamed — would keep the engines on the old policy while the versions advance); with merged
        sync, warn once when the part of the update lost to rounding exceeds :data:`MERGE_ROUNDING_BOUND`.

        Raises:
            AdapterSyncError: the payload of version v equals version v − 1's after such an update.
        """
        version, crc = report.policy_version, report.adapter_checksum
        if crc is not None:
            norm = result.grad_norm
            moved = not result.skipped and norm is not None and math.isfinite(norm) and norm > 0
            if moved and self._adapter_payload == (version - 1, crc):
                raise AdapterSyncError(
                    f"policy version {version}: the LoRA adapter payload streamed to the engines (CRC-32 {crc:#010x}) "
                    f"is the same as version {version - 1}'s although the step applied an update with gradient norm "
                    f"{norm:.3g}: the adapter is frozen (the optimizer does not move the streamed tensors); the "
                    f"engines would keep sampling version {version - 1}")
            self._adapter_payload = (version, crc)
        error = report.merge_update_error
        if error is not None and error > MERGE_ROUNDING_BOUND and not self._rounding_warned:
            self._rounding_warned = True
            self._status(f"warning: policy version {version}: the merged LoRA weights the engines received lose "
                         f"{error:.2f} x the LoRA update's norm to rounding (bound {MERGE_ROUNDING_BOUND:g}: "
                         f"model.dtype {self.spec.model.dtype} rounds small updates back to the base weights, so "
                         f"the engines sample another policy than the trainer's); use train.lora.sync: adapter "
                         f"(sync/merge_update_error is logged every step)")
