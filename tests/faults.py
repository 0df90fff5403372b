"""Fault injection for tests, kept out of production code: train backends that fail on purpose.

- :class:`NonFiniteStepWorker`: :class:`train_workers.fsdp_worker.FSDPTrainWorker` composed with
  :class:`NonFiniteStep`, a :class:`train_workers.grpo_step.GRPOStep` with its seams (``_microbatch_loss``,
  ``_forward_backward``) overridden; ``fail_next_step`` makes this rank's next step non-finite. Tests build it in
  process (``tests/distributed``); :func:`nonfinite_backend` makes a subclass that poisons given train-step calls by
  itself, to register under a test name (``train.strategy``) for a whole job.
- :func:`crashing_backend`: an FSDP2 backend whose rank r ends its own process at the start of train step s, once per
  planned step across job restarts (a lost train rank).
- :class:`RegistryProbe`: a stand-in train rank that answers what its registries hold.

Backends built by a function are classes defined inside it, so Ray pickles them by value (with their plan) into the
rank actors. Register one for a test with ``tests.registered.variant_registered(TRAIN_BACKENDS, name, lambda:
register_train_backend(name, cls))``. Faults of the Ray fleet (killed engines, lost nodes) are in
``tests/ray_faults.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

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


class RegistryProbe:
    """A stand-in train rank for Ray tests: answers whether its loss-aggregation registry holds a name."""

    def has_loss_aggregation(self, name: str) -> bool:
        from grpo.losses import LOSS_AGGREGATIONS

        return name in LOSS_AGGREGATIONS


def nonfinite_backend(calls: set[int], rank: int = 0, metric: str = "loss") -> type:
    """A :class:`NonFiniteStepWorker` subclass whose rank ``rank`` poisons its ``metric`` at the train-step calls
    ``calls`` (1-based count of ``train_step`` calls on that rank object), by itself.

    Raises:
        ValueError: ``metric`` is neither ``"loss"`` nor ``"grad_norm"`` (at the first poisoned call).
    """
    poisoned = frozenset(calls)

    class ScheduledNonFiniteWorker(NonFiniteStepWorker):
        """Poisons its own train-step calls :data:`poisoned` on rank ``rank``."""

        _calls = 0

        def train_step(self, microbatches, num_tokens, num_sequences):
            self._calls += 1
            if self.ctx.rank == rank and self._calls in poisoned:
                self.fail_next_step(metric)
            return super().train_step(microbatches, num_tokens, num_sequences)

    return ScheduledNonFiniteWorker


def crashing_backend(plan: Mapping[int, int], marker_dir: str | Path) -> type:
    """An FSDP2 backend whose rank ``plan[s]`` ends its process (``os._exit``, as a crash or an OOM kill would) at
    the start of train step ``s``, once: the rank claims ``marker_dir/crash_<s>_<rank>`` first (so a
    job restarted from a checkpoint trains that step normally). Step ``s`` is the one that trains policy version
    ``s - 1`` (``rollout.mode: sync``, no skipped update).

    ``crashed(marker_dir)`` lists the crashes done so far as (step, rank).
    """
    plan = dict(plan)
    folder = str(marker_dir)

    class CrashingTrainWorker(FSDPTrainWorker):
        """FSDP2 rank that crashes at its planned train steps."""

        def train_step(self, microbatches, num_tokens, num_sequences):
            step = self.policy_version + 1
            if plan.get(step) == self.ctx.rank:
                try:
                    fd = os.open(os.path.join(folder, f"crash_{step}_{self.ctx.rank}"), os.O_CREAT | os.O_EXCL)
                except FileExistsError:
                    fd = None
                if fd is not None:
                    os.close(fd)
                    os._exit(1)
            return super().train_step(microbatches, num_tokens, num_sequences)

    return CrashingTrainWorker


def crashed(marker_dir: str | Path) -> list[tuple[int, int]]:
    """The (step, rank) crashes a :func:`crashing_backend` with ``marker_dir`` has made, by step."""
    return sorted(tuple(int(x) for x in p.name.split("_")[1:]) for p in Path(marker_dir).glob("crash_*"))
