"""Pipeline parallelism (pp > 1) of the Megatron backend: megatron-core's schedule runs the micro-batches, the last
stage calls back the GRPO step for each micro-batch's loss.

:class:`MegatronPipeline` is the :class:`~train_workers.step_engine.PipelineSchedule` of
:class:`train_workers.megatron.engine.MegatronEngine` at pp > 1 (at pp = 1 the engine has none and
:class:`train_workers.grpo_step.GRPOStep` runs the micro-batches one by one). The step's passes over the micro-batches
(behaviour, reference, gradient) each go through it; the step keeps the bookkeeping (records, phase times, metric
sums), this module only runs the schedule.

Schedule: ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (pp > 1 without virtual stages:
``forward_backward_pipelining_without_interleaving``, 1F1B, ``pipeline_parallel/schedules.py``) with
``forward_step_func(data_iterator, model) → (output, loss_func)``. Every stage runs the same micro-batches, in the same
order (the worker gathers those of the whole model-parallel group and drops the empty placeholders), each turned into a
:class:`~train_workers.megatron.policy.StageBatch` and right-padded to one shape [R, S] for the step — R the most
sequences and S the longest sequence of any of its micro-batches — because the schedule's p2p communication receives a
fixed [S, R, H] tensor (``seq_length``, ``micro_batch_size``; ``config.variable_seq_lengths`` stays off). The first
stage embeds the tokens, the others take the previous stage's hidden states (``set_input_tensor``), the last stage
returns (logprobs [M], entropy [M]) and ``loss_func`` is the GRPO step's loss on them — the same clipped surrogate, KL
to the reference policy, TIS/MIS, NaN/Inf flags and metric sums as FSDP2 — times ``world_size`` (as the engine's
``backward`` at pp = 1), returned as ``(loss, num_tokens, {})`` with ``calculate_per_token_loss=True``
(``config.transformer_config``), so the schedule back-propagates it unscaled. The schedule calls backward itself;
gradients accumulate in ``.grad``.

Forward-only passes (the reference policy's logprobs, and the policy's behaviour logprobs before the first update with
``num_iterations`` > 1 or ``algorithm.mis``) run the same schedule with ``forward_only=True`` under ``torch.no_grad``;
their ``loss_func`` returns each micro-batch's logprobs [n, T] as the third element, which the schedule collects in
order (``forward_data_store``) on the last stage. Only the last stage holds logprobs and computes the loss; the other
stages' records carry ``old=None`` and their metric sums are zeros, and the engine reduces the sums over the ranks of
one tensor-parallel rank across every stage and replica, so each sequence counts once and every rank reports the same
metrics and takes the same skip decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from contract.batches import PackedMicroBatch
from train_workers.step_engine import LossFn, device_inputs


@dataclass
class Staged:
    """A step's micro-batches and their :class:`~train_workers.megatron.policy.StageBatch` es, padded to the step's
    common [R, S] (the same on every stage)."""

    microbatches: list[PackedMicroBatch]
    batches: list


class MegatronPipeline:
    """Megatron-core's pipeline schedule over the policy and the reference policy (module docstring).

    Args:
        policy, reference: this stage's :class:`~train_workers.megatron.policy.MegatronResponseLogprobs` (reference
            None without one). device: this rank's device. world_size: the train group's size (the loss scale).
    """

    def __init__(self, policy, reference, device: torch.device, world_size: int):
        self.policy, self.reference, self.device, self.world_size = policy, reference, device, world_size

    def prepare(self, microbatches: list[PackedMicroBatch]) -> Staged:
        """Each micro-batch as a ``StageBatch`` padded to the step's common [R, S]."""
        from train_workers.megatron.policy import stage_batch

        batches = [stage_batch(*device_inputs(mb, self.device)) for mb in microbatches]
        if batches:
            rows = max(b.ids.shape[0] for b in batches)
            seq_len = max(b.ids.shape[1] for b in batches)
            batches = [b.padded(rows, seq_len) for b in batches]
        return Staged(list(microbatches), batches)

    def _schedule(self, module, batches: list, forward_only: bool, loss_func) -> list:
        """Run megatron-core's pipeline schedule of ``module`` (a ``MegatronResponseLogprobs``) over ``batches``.

        Args:
            loss_func: ``(index, (logprobs [M], entropy [M] or None)) → (loss, num_tokens, data)``, called on the
                last stage for micro-batch ``index``.

        Returns:
            the schedule's ``forward_data_store``: each micro-batch's ``data``, in order, on the last stage; [] on
            the others.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not batches:
            return []
        rows, seq_len = batches[0].ids.shape

        def forward_step(data_iterator, model):
            index, batch = next(data_iterator)
            return module.stage_forward(batch, with_entropy=not forward_only), partial(loss_func, index)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(enumerate(batches)), model=[module.model],
            num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=rows, forward_only=forward_only)

    def logprobs(self, staged: Staged, reference: bool) -> list[torch.Tensor | None]:
        """Logprobs [n, T] float32 (0 at padding) of each staged micro-batch under the policy (or the reference
        policy), without gradient, on the last stage; Nones on the other stages."""
        microbatches = staged.microbatches

        def collect(index: int, out: tuple):
            logprobs, _ = out
            return logprobs.new_zeros(()), torch.zeros((), dtype=torch.int), \
                microbatches[index].to_padded(logprobs.float()).clone()

        with torch.no_grad():
            store = self._schedule(self.reference if reference else self.policy, staged.batches, forward_only=True,
                                   loss_func=collect)
        return list(store) if self.policy.model.post_process else [None] * len(microbatches)

    def forward_backward(self, staged: Staged, loss_fn: LossFn) -> None:
        """Forward and backward of every staged micro-batch through the policy; on the last stage ``loss_fn`` gives
        each micro-batch's loss, back-propagated times ``world_size``."""
        def loss_func(index: int, out: tuple):
            loss, tokens = loss_fn(index, out)
            return loss * self.world_size, torch.tensor(tokens, dtype=torch.int), {}

        self._schedule(self.policy, staged.batches, forward_only=False, loss_func=loss_func)
