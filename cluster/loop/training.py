"""The train stage seen from the loop: pack the batch into per-rank micro-batches, call the train pool, and count
updates skipped for NaN/Inf.

The functions :func:`train_step`, :func:`set_kl_coef`, :func:`save_train_state` and :func:`load_train_state` are
the only places the loop calls the train pool (its typed methods; a step answers a
:class:`contract.messages.TrainResult`).
"""

from __future__ import annotations

from collections.abc import Callable

from contract.protocols import Trainer
from contract.batches import RolloutBatch
from cluster.loop.scheduler import plan_microbatches
from contract.messages import TrainResult
from train_workers.packing import pack_rank_microbatches


class NumericsError(RuntimeError):
    """``train.max_skipped_updates`` updates in a row had a NaN/Inf loss or gradient."""


def microbatches(batch: RolloutBatch, train) -> tuple[list, dict]:
    """Balance the batch's N sequences over ``train.world_size`` ranks and pack each rank's micro-batches under
    ``train.max_tokens_per_microbatch`` tokens (prompt + response).

    Returns:
        (per rank: its packed micro-batches, the plan's ``packing/*`` metrics).
    """
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    plan = plan_microbatches(lengths, train.world_size, train.max_tokens_per_microbatch,
                             oversize=train.oversize_sequences)
    per_rank = pack_rank_microbatches(plan.ranks, batch.prompt_ids, batch.response_ids, batch.advantages,
                                      batch.behaviour_logprobs, batch.valid_lengths, group_ids=batch.group_ids)
    return per_rank, plan.stats(lengths)


def train_step(train: Trainer, per_rank: list, num_tokens: int, num_sequences: int) -> TrainResult:
    """One train step on every rank.

    Args:
        per_rank: each rank's micro-batches (:func:`microbatches`).
        num_tokens, num_sequences: loss tokens and sequences with at least one, over the whole batch.

    Returns:
        the step's :class:`TrainResult`: policy version after the step, whether (and why) an update was skipped,
        and the trainer's numeric metrics (``actor/update_skipped`` among them: the fraction of iterations
        skipped).
    """
    return train.train_step(per_rank, num_tokens, num_sequences)


def set_kl_coef(train: Trainer, kl_coef: float) -> None:
    """Set β on every rank for the following train steps (adaptive KL controller)."""
    train.set_kl_coef(kl_coef)


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
    """Counts updates skipped for NaN/Inf: in a row (reset by a good update) and in total.

    Args:
        limit: ``train.max_skipped_updates``; that many in a row stop the job.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.total = 0

    def reset(self) -> None:
        """A good update: the run of skipped ones ends."""
        self.in_a_row = 0

    def note(self, reason: str, step: int, policy_version: int, status: Callable[[str], None]) -> None:
        """Count a skipped update (``reason``: the non-finite metric, or ``""``) and say so on ``status``.

        Raises:
            NumericsError: ``limit`` updates in a row were skipped (naming the step, the metric and the last good
                policy version).
        """
        self.in_a_row += 1
        self.total += 1
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
