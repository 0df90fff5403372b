"""Pipeline parallelism (pp > 1) of the Megatron worker: megatron-core's schedule runs the micro-batches, the last
stage computes ``FSDPStep``'s loss.

:class:`PipelineStep` is a mixin of :class:`train_workers.megatron.worker.MegatronTrainWorker` placed before
``FSDPStep``: at pp = 1 it defers to ``FSDPStep``; at pp > 1 it overrides the two seams where the micro-batch loop
lives (``FSDPStep._forward_backward``, ``FSDPStep._behaviour_passes``) and :meth:`PipelineStep.reference_logprobs`.

Schedule: ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (pp > 1 without virtual stages:
``forward_backward_pipelining_without_interleaving``, 1F1B, ``pipeline_parallel/schedules.py``) with
``forward_step_func(data_iterator, model) → (output, loss_func)``. Every stage runs the same micro-batches, in the same
order (the worker gathers those of the whole model-parallel group and drops the empty placeholders), each turned into a
:class:`~train_workers.megatron.policy.StageBatch` and right-padded to one shape [R, S] for the step — R the most
sequences and S the longest sequence of any of its micro-batches — because the schedule's p2p communication receives a
fixed [S, R, H] tensor (``seq_length``, ``micro_batch_size``; ``config.variable_seq_lengths`` stays off). The first
stage embeds the tokens, the others take the previous stage's hidden states (``set_input_tensor``), the last stage
returns (logprobs [M], entropy [M]) and ``loss_func`` is ``FSDPStep._microbatch_loss`` on them — the same clipped
surrogate, KL to the reference policy, TIS/MIS, NaN/Inf flags and metric sums as FSDP2, times ``world_size`` as there —
returned as ``(loss, num_tokens, {})`` with ``calculate_per_token_loss=True`` (``config.transformer_config``), so the
schedule back-propagates it unscaled. The schedule calls backward itself; gradients accumulate in ``.grad``.

Forward-only passes (the reference policy's logprobs, and the policy's behaviour logprobs before the first update with
``num_iterations`` > 1 or ``algorithm.mis``) run the same schedule with ``forward_only=True`` under ``torch.no_grad``;
their ``loss_func`` returns each micro-batch's logprobs [n, T] as the third element, which the schedule collects in
order (``forward_data_store``) on the last stage. Only the last stage holds logprobs and computes the loss; the other
stages' saved records carry ``old=None`` and their metric sums are zeros, and the worker reduces the sums over the
ranks of one tensor-parallel rank across every stage and replica (``_metrics_group``), so each sequence counts once and
every rank reports the same metrics and takes the same skip decision.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

from train_workers.fsdp_step import SUMS, Saved
from contract.batches import PackedMicroBatch


class PipelineStep:
    """Pipeline-parallel train-step methods of the Megatron worker (module docstring). Uses the worker's ``layout``,
    ``policy``, ``reference``, ``device``, ``world_size``, ``pp_group`` and ``_phase_s``."""

    def _pipelined(self) -> bool:
        return self.layout.pp > 1

    def _stage_batches(self, microbatches: list[PackedMicroBatch]) -> list:
        """Each micro-batch as a :class:`StageBatch` padded to the step's common [R, S] (the same on every stage:
        every stage holds the same micro-batches)."""
        from train_workers.megatron.policy import stage_batch

        batches = [stage_batch(*self._inputs(mb)) for mb in microbatches]
        rows = max(b.ids.shape[0] for b in batches)
        seq_len = max(b.ids.shape[1] for b in batches)
        return [b.padded(rows, seq_len) for b in batches]

    def _schedule(self, module, batches: list, forward_only: bool, loss_func) -> list:
        """Run megatron-core's pipeline schedule of ``module`` (a :class:`MegatronResponseLogprobs`) over ``batches``.

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

    def _pipeline_logprobs(self, module, microbatches: list[PackedMicroBatch], batches: list) -> list:
        """Logprobs [n, T] float32 (0 at padding) of each micro-batch under ``module``, without gradient, on the last
        stage; Nones on the other stages."""
        def collect(index: int, out: tuple):
            logprobs, _ = out
            return logprobs.new_zeros(()), torch.zeros((), dtype=torch.int), \
                microbatches[index].to_padded(logprobs.float()).clone()

        with torch.no_grad():
            store = self._schedule(module, batches, forward_only=True, loss_func=collect)
        return list(store) if self.policy.model.post_process else [None] * len(microbatches)

    def _reference_pass(self, microbatches: list[PackedMicroBatch], batches: list) -> list:
        """Reference-policy logprobs of each micro-batch (last stage; Nones elsewhere, and without a reference)."""
        if self.reference is None:
            return [None] * len(microbatches)
        t0 = time.perf_counter()
        out = self._pipeline_logprobs(self.reference, microbatches, batches)
        self._phase_s["ref_forward"] += time.perf_counter() - t0
        return out

    def _behaviour_passes(self, microbatches: list[PackedMicroBatch]) -> list[Saved]:
        """``FSDPStep._behaviour_passes`` through the pipeline: the policy's and the reference policy's logprobs
        before the first update (``old=None``, ``ref=None`` on stages other than the last)."""
        if not self._pipelined():
            return super()._behaviour_passes(microbatches)
        if not microbatches:
            return []
        batches = self._stage_batches(microbatches)
        t0 = time.perf_counter()
        olds = self._pipeline_logprobs(self.policy, microbatches, batches)
        self._phase_s["behaviour"] += time.perf_counter() - t0
        refs = self._reference_pass(microbatches, batches)
        return [Saved(old=old, ref=ref, forward_tokens=mb.num_tokens)
                for mb, old, ref in zip(microbatches, olds, refs)]

    def _forward_backward(self, microbatches: list[PackedMicroBatch], saved: list, num_tokens: int,
                          num_sequences: int, first: bool) -> torch.Tensor:
        """``FSDPStep._forward_backward`` through megatron-core's schedule (module docstring); returns this rank's
        metric sums (zeros on stages other than the last)."""
        if not self._pipelined():
            return super()._forward_backward(microbatches, saved, num_tokens, num_sequences, first)
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        if not microbatches:
            return sums
        batches = self._stage_batches(microbatches)
        refs = [s.ref for s in saved] if saved[0] is not None else self._reference_pass(microbatches, batches)

        def loss_func(index: int, out: tuple):
            loss, mb_sums = self._microbatch_loss(microbatches[index], None, saved[index], refs[index], num_tokens,
                                                  num_sequences, first, policy_out=out)
            sums.add_(mb_sums)
            tokens = torch.tensor(int(mb_sums[SUMS["tokens"]]), dtype=torch.int)
            return loss * self.world_size, tokens, {}

        t0 = time.perf_counter()
        self._schedule(self.policy, batches, forward_only=False, loss_func=loss_func)
        self._phase_s["policy_fwd_bwd"] += time.perf_counter() - t0
        return sums

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """``FSDPStep.reference_logprobs`` through the pipeline: [n, T] float32 on every rank (the last stage
        broadcasts it over the pipeline-parallel group; a collective over the model-parallel group)."""
        if not self._pipelined():
            return super().reference_logprobs(mb)
        if not self._has_reference():
            return None
        if mb.num_sequences == 0:
            return torch.zeros(mb.response_mask.shape, dtype=torch.float32)
        out = self._reference_pass([mb], self._stage_batches([mb]))[0]
        if out is None:
            out = torch.empty(mb.response_mask.shape, dtype=torch.float32, device=self.device)
        last = dist.get_global_rank(self.pp_group, self.layout.pp - 1)
        dist.broadcast(out, src=last, group=self.pp_group)
        return out
