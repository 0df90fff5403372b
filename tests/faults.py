"""Fault injection for tests: a train worker whose next step turns non-finite, and a way to put it in a train pool.

:class:`NonFiniteStepWorker` is :class:`train_workers.fsdp_worker.FSDPTrainWorker` with its step seams
(``_microbatch_loss``, ``_clip_gradients``) overridden; production code carries no test hooks. Tests build it in
process (``tests/distributed``) or have ``TrainPool`` start it on every rank (:func:`use_in_train_pool`) and call
``fail_next_step`` on the rank actor they want to poison.
"""

from __future__ import annotations

import torch

from train_workers.fsdp_step import SUMS
from train_workers.fsdp_worker import FSDPTrainWorker


class NonFiniteStepWorker(FSDPTrainWorker):
    """An FSDP2 train rank that can make its next ``train_step`` non-finite on this rank alone (the other ranks
    learn of it from the all-reduced flags, and every rank skips the update)."""

    _fail_next: str | None = None  # armed by fail_next_step, consumed by the next train_step
    _failing: str | None = None    # the metric being poisoned during the current train_step
    _first_mb = None               # the current step's first micro-batch (the one whose loss is poisoned)

    def fail_next_step(self, metric: str = "loss") -> None:
        """Make this rank's next ``train_step`` non-finite.

        ``"loss"`` multiplies the first micro-batch's loss by NaN in every iteration (so its gradients are NaN too);
        ``"grad_norm"`` sets one gradient element to +Inf after the backward (finite loss).

        Raises:
            ValueError: ``metric`` is neither ``"loss"`` nor ``"grad_norm"``.
        """
        if metric not in ("loss", "grad_norm"):
            raise ValueError(f"metric must be 'loss' or 'grad_norm', got {metric!r}")
        self._fail_next = metric

    def train_step(self, microbatches, num_tokens, num_sequences):
        self._failing, self._fail_next = self._fail_next, None
        self._first_mb = microbatches[0] if microbatches else None
        try:
            return super().train_step(microbatches, num_tokens, num_sequences)
        finally:
            self._failing, self._first_mb = None, None

    def _microbatch_loss(self, mb, *args, **kwargs):
        loss, sums = super()._microbatch_loss(mb, *args, **kwargs)
        if self._failing == "loss" and mb is self._first_mb:
            loss = loss * float("nan")
            sums[SUMS["loss"]] = float("nan")
        return loss, sums

    def _clip_gradients(self) -> float:
        if self._failing == "grad_norm":
            _poison_one_grad(self.policy)
        return super()._clip_gradients()


def _poison_one_grad(model: torch.nn.Module) -> None:
    """Set the first element of this rank's local part of the first gradient to +Inf."""
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if g.numel():
                g.view(-1)[0] = float("inf")
                return


def use_in_train_pool(monkeypatch, strategy: str = "fsdp") -> None:
    """Make ``TrainPool`` start :class:`NonFiniteStepWorker` for ``train.strategy`` = ``strategy`` until the test
    ends (``monkeypatch`` restores the registry's entry)."""
    from train_workers.registry import TRAIN_BACKENDS

    monkeypatch.setitem(TRAIN_BACKENDS, strategy, NonFiniteStepWorker)


class RegistryProbe:
    """A stand-in train rank for Ray tests: answers whether its loss-aggregation registry holds a name."""

    def has_loss_aggregation(self, name: str) -> bool:
        from grpo.losses import LOSS_AGGREGATIONS

        return name in LOSS_AGGREGATIONS
