"""What the GRPO step asks of a train backend: the :class:`StepEngine` protocol, the :class:`PipelineSchedule` a
pipeline-parallel backend adds, and the small helpers the engines share.

:class:`train_workers.grpo_step.GRPOStep` owns the algorithm (loss, KL, TIS/MIS, the behaviour pass, the NaN/Inf skip,
the metrics); an engine owns the models (the policy, the frozen reference policy, the optimizer) and how they are laid
out over the ranks. FSDP2's engine is :class:`train_workers.fsdp_engine.FSDPEngine`, Megatron-core's
:class:`train_workers.megatron.engine.MegatronEngine`; each worker holds one engine and one ``GRPOStep``.

A step drives the engine micro-batch by micro-batch (:meth:`StepEngine.prepare_microbatch`, the forwards,
:meth:`StepEngine.backward`) unless the engine has a :attr:`StepEngine.pipeline`: then the schedule runs every
micro-batch of a pass at once and calls the step back for each micro-batch's loss on the stage that computes it.

Notation: n sequences in a micro-batch, T their longest response (tokens), M the response tokens of a packed
micro-batch (the policy's flat output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from contract.batches import PackedMicroBatch

#: ``(index, (logprobs [M], entropy [M])) → (loss, loss tokens)``: the step's loss of micro-batch ``index`` from the
#: policy's output (scalar float32 with autograd, unscaled; the engine scales it as its gradient reduction needs).
LossFn = Callable[[int, tuple], tuple[torch.Tensor, int]]


class PipelineSchedule(Protocol):
    """A pipeline-parallel schedule over every micro-batch of a pass (Megatron pp > 1:
    :class:`train_workers.megatron.pipeline.MegatronPipeline`). Every stage calls each method together."""

    def prepare(self, microbatches: list[PackedMicroBatch]) -> object:
        """The micro-batches staged for this step's passes (an opaque handle the other methods take)."""
        ...

    def logprobs(self, staged: object, reference: bool) -> list[torch.Tensor | None]:
        """No-grad logprobs [n, T] float32 (0 at padding) of each staged micro-batch under the policy, or the frozen
        reference policy with ``reference``; on the stage that computes the loss, Nones on the others."""
        ...

    def forward_backward(self, staged: object, loss_fn: LossFn) -> None:
        """Forward and backward of every staged micro-batch through the policy (gradients accumulate in ``.grad``);
        ``loss_fn`` is called on the stage that computes the loss."""
        ...


class StepEngine(Protocol):
    """The models of one train rank as :class:`train_workers.grpo_step.GRPOStep` drives them (module docstring).
    The methods marked collective are called on every rank together."""

    #: The schedule that runs whole passes (pipeline parallelism), or None: the step runs micro-batch by micro-batch.
    pipeline: PipelineSchedule | None
    #: The optimizer over the policy's trainable parameters (the step sets its learning rate: ``GRPOStep.set_lr``).
    optimizer: torch.optim.Optimizer

    @property
    def has_reference(self) -> bool:
        """Whether the job has a reference policy (a frozen copy, or the LoRA policy with its adapters off)."""
        ...

    def inputs(self, mb: PackedMicroBatch) -> tuple:
        """``mb``'s ``(input_ids, position_ids, logit_positions, targets)`` on this rank's device."""
        ...

    def prepare_microbatch(self, last: bool) -> None:
        """Called before each micro-batch of a gradient pass; ``last``: the pass's final one (gradient sync)."""
        ...

    def policy_forward(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (logprobs [M], entropy [M]) with autograd, from :meth:`inputs`."""
        ...

    def behaviour_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The policy's logprobs [n, T] float32 (0 at padding) without gradient, before the step's first update."""
        ...

    def reference_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The reference policy's logprobs [n, T] float32 (0 at padding), a normal tensor the loss's autograd may
        save. Only called when :attr:`has_reference`; a collective when the reference policy is sharded."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss (its share of the global batch loss), scaled as the engine's
        gradient reduction needs."""
        ...

    def clip_gradients(self) -> float:
        """Collective. Reduce the gradients over the ranks, clip them to ``train.max_grad_norm`` by their global L2
        norm and return the norm before clipping (NaN/Inf when any gradient element is)."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``)."""
        ...

    def optimizer_step(self) -> None:
        """One optimizer update from the clipped gradients."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Collective. Sum a small CPU tensor over the ranks such that every sequence counts once (the data-parallel
        group, or the ranks of one tensor-parallel rank across stages and replicas); returns a CPU tensor."""
        ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Collective. :meth:`all_reduce_sum` with MAX."""
        ...

    def extra_metrics(self) -> dict[str, float]:
        """The backend's own per-step metrics (a collective where they need one); {} when it has none."""
        ...


def device_inputs(mb: PackedMicroBatch, device: torch.device) -> tuple:
    """``(input_ids, position_ids, logit_positions, targets)`` of ``mb`` on ``device``."""
    return mb.input_ids.to(device), mb.position_ids.to(device), mb.logit_positions.to(device), mb.targets.to(device)


def no_grad_logprobs(module, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
    """``module``'s logprobs [n, T] float32 of ``mb`` (0 at padding) under ``torch.no_grad``; ``args`` from
    :func:`device_inputs`."""
    with torch.no_grad():
        flat, _ = module(*args, with_entropy=False)
    return mb.to_padded(flat.float())


def frozen_logprobs(module, mb: PackedMicroBatch, args: tuple, inference: bool) -> torch.Tensor:
    """A frozen module's logprobs [n, T] float32 of ``mb`` (0 at padding), copied out as a normal tensor (the
    loss's autograd may save it). ``inference``: run under ``torch.inference_mode`` (a plain module only: FSDP2's
    hooks manage their own tensors)."""
    with torch.inference_mode(inference), torch.no_grad():
        flat, _ = module(*args, with_entropy=False)
        out = mb.to_padded(flat.float())
    return out.clone()


def all_reduce_cpu(t: torch.Tensor, device: torch.device, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``op`` (default SUM) of a small CPU tensor over ``group`` (None: the train group); NCCL reduces device tensors
    only, so it goes via ``device``. Returns a CPU tensor."""
    on_device = t.to(device)
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()
