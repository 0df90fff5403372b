"""Fault injection for tests: a train worker whose next step turns non-finite, and a way to put it in a train pool.

:class:`NonFiniteStepWorker` is :class:`train_workers.fsdp_worker.FSDPTrainWorker` composed with
:class:`NonFiniteStep`, a :class:`train_workers.grpo_step.GRPOStep` with its seams (``_microbatch_loss``,
``_forward_backward``) overridden; production code carries no test hooks. Tests build it in process
(``tests/distributed``) or have ``TrainPool`` start it on every rank (:func:`use_in_train_pool`) and call
``fail_next_step`` on the rank actor they want to poison.
"""

from __future__ import annotations

import torch

from train_workers.fsdp_worker import FSDPTrainWorker
from train_workers.grpo_step import GRPOStep
from train_workers.step_metrics import SUMS


class NonFiniteStep(GRPOStep):
    """A GRPO step that can make its next ``train_step`` non-finite on this rank alone (the other ranks learn of it
    from the all-reduced flags, and every rank skips the update)."""

    fail_next: str | None = None  # armed by NonFiniteStepWorker.fail_next_step, consumed by the next train_step
    _failing: str | None = None   # the metric being poisoned during the current train_step
    _first_mb = None              # the current step's first micro-batch (the one whose loss is poisoned)

    def train_step(self, microbatches, *args, **kwargs):
        self._failing, self.fail_next = self.fail_next, None
        self._first_mb = microbatches[0] if microbatches else None
        try:
            return super().train_step(microbatches, *args, **kwargs)
        finally:
            self._failing, self._first_mb = None, None

    def _microbatch_loss(self, mb, *args, **kwargs):
        loss, sums = super()._microbatch_loss(mb, *args, **kwargs)
        if self._failing == "loss" and mb is self._first_mb:
            loss = loss * float("nan")
            sums[SUMS["loss"]] = float("nan")
        return loss, sums

    def _forward_backward(self, *args, **kwargs):
        sums = super()._forward_backward(*args, **kwargs)
        if self._failing == "grad_norm":  # after the backward, before the engine clips
            _poison_one_grad(self.engine.policy)
        return sums


class NonFiniteStepWorker(FSDPTrainWorker):
    """An FSDP2 train rank whose GRPO step is a :class:`NonFiniteStep`."""

    def init_distributed(self, *args, **kwargs):
        info = super().init_distributed(*args, **kwargs)
        self.step = NonFiniteStep(self.engine, self.ctx.algorithm, self.ctx.train, self.ctx.max_response_tokens)
        return info

    def fail_next_step(self, metric: str = "loss") -> None:
        """Make this rank's next ``train_step`` non-finite.

        ``"loss"`` multiplies the first micro-batch's loss by NaN in every iteration (so its gradients are NaN too);
        ``"grad_norm"`` sets one gradient element to +Inf after the backward (finite loss).

        Raises:
            ValueError: ``metric`` is neither ``"loss"`` nor ``"grad_norm"``.
        """
        if metric not in ("loss", "grad_norm"):
            raise ValueError(f"metric must be 'loss' or 'grad_norm', got {metric!r}")
        self.step.fail_next = metric


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
