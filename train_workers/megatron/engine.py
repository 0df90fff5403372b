"""The Megatron-core step engine: how the GRPO step runs on a TP × PP × DP sharded policy (:class:`MegatronEngine`).

:class:`train_workers.megatron.worker.MegatronTrainWorker` builds the models and Megatron's parallel state and
composes this engine with :class:`train_workers.grpo_step.GRPOStep` (the protocol:
:class:`train_workers.step_engine.StepEngine`). At pp = 1 the step runs the micro-batches one by one through the
engine; at pp > 1 the engine's :attr:`MegatronEngine.pipeline`
(:class:`train_workers.megatron.pipeline.MegatronPipeline`) runs each pass. What is Megatron's own here:

- Gradients (:meth:`MegatronEngine.clip_gradients`). Parameters are local shards (Megatron's ``ColumnParallelLinear``/
  ``RowParallelLinear``/``VocabParallelEmbedding``, ``megatron/core/tensor_parallel/layers.py``): the TP collectives
  of the forward and backward make each shard's gradient exact, and replicated parameters (the RMSNorm weights) get
  identical gradients on every tp rank — except with ``train.sequence_parallel``, where each tp rank's norm gradients
  cover its share of the sequence and are first summed over the TP group (megatron-core's
  ``_allreduce_layernorm_grads`` in ``megatron/core/distributed/finalize_model_grads.py``). The gradients are then
  summed over the dp group (``all_reduce``), a tied embedding's two copies (pp > 1) summed over Megatron's embedding
  group, the global L2 norm is taken over every parameter once across tp and pp (TP-duplicates counted on tp rank 0
  only, ``param_is_not_tensor_parallel_duplicate``; the tied copy not at all, ``param_is_not_shared``) and clipped as
  ``torch.nn.utils.clip_grad_norm_`` does.
- Metric sums (:meth:`MegatronEngine.all_reduce_sum`) are reduced so each sequence counts once: over the
  data-parallel group at pp = 1, over the ranks of one tp rank across every stage and replica at pp > 1 (only the
  last stage has loss sums) — the worker passes that group as ``metrics_group``.
- The reference policy is a full TP-sharded replica on every dp rank (no FSDP wrapping), run under
  ``torch.inference_mode``; nothing is unsharded between micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from contract.batches import PackedMicroBatch
from train_workers.step_engine import all_reduce_cpu, device_inputs, frozen_logprobs, no_grad_logprobs


class MegatronEngine:
    """The :class:`~train_workers.step_engine.StepEngine` of one Megatron rank (module docstring).

    Args:
        policy, reference: this rank's :class:`~train_workers.megatron.policy.MegatronResponseLogprobs` (reference
            None when ``kl_coef`` is 0). optimizer: AdamW over the policy's local shards.
        world_size: the train group's size. device: this rank's device. max_grad_norm: ``train.max_grad_norm``.
        layout: the :class:`~train_workers.megatron.config.MegatronLayout`. tp_group, dp_group: Megatron's
            tensor- and data-parallel groups. metrics_group: the group the step's metric sums are reduced over.
        pipeline: the schedule at pp > 1, None at pp = 1.
    """

    def __init__(self, policy, reference, optimizer: torch.optim.Optimizer, world_size: int, device: torch.device,
                 max_grad_norm: float, layout, tp_group, dp_group, metrics_group, pipeline=None):
        self.policy, self.reference = policy, reference
        self.optimizer = optimizer
        self.world_size, self.device, self.max_grad_norm = world_size, device, max_grad_norm
        self.layout, self.tp_group, self.dp_group, self.metrics_group = layout, tp_group, dp_group, metrics_group
        self.pipeline = pipeline

    @property
    def has_reference(self) -> bool:
        """Whether the frozen reference policy was built (``kl_coef`` > 0)."""
        return self.reference is not None

    def inputs(self, mb: PackedMicroBatch) -> tuple:
        """``(input_ids, position_ids, logit_positions, targets)`` of ``mb`` on this rank's device."""
        return device_inputs(mb, self.device)

    def prepare_microbatch(self, last: bool) -> None:
        """Nothing: gradients stay local until :meth:`clip_gradients` (parameters are Megatron shards)."""

    def policy_forward(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (logprobs [M], entropy [M]) with autograd (pp = 1)."""
        return self.policy(*args)

    def behaviour_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The policy's logprobs [n, T] float32 without gradient (pp = 1)."""
        return no_grad_logprobs(self.policy, mb, args)

    def reference_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The reference replica's logprobs [n, T] float32 under ``inference_mode`` (pp = 1; a collective over the
        TP group at tp > 1)."""
        return frozen_logprobs(self.reference, mb, args, inference=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss × world_size``, as FSDP2 does; :meth:`clip_gradients` divides the dp sum by it."""
        (loss * self.world_size).backward()

    def clip_gradients(self) -> float:
        """Sum the gradients over the dp group (and a tied embedding's two copies over the embedding group), clip
        them to ``max_grad_norm`` by their global L2 norm and return the norm before clipping (NaN/Inf when any
        gradient element is).

        With sequence parallelism the gradients of the parameters marked ``sequence_parallel`` (the RMSNorm
        weights, ``config.SequenceParallelRMSNorm``) hold only this tp rank's share of the sequence and are first
        summed over the TP group, as megatron-core's ``finalize_model_grads`` (``_allreduce_layernorm_grads``) does.

        Each loss was back-propagated times ``world_size`` (:meth:`backward`); the dp sum is divided by
        ``world_size`` so the gradient is that of the batch loss. With pp > 1 and tied embeddings the first stage's
        ``word_embeddings`` and the last stage's copy (``output_layer.weight``) each hold part of the gradient; they
        are summed over ``parallel_state.get_embedding_group()`` so both copies take the same update, as megatron-core's
        ``finalize_model_grads`` (``_allreduce_word_embedding_grads``) does after the dp reduction. Norm: sqrt(Σ over
        every parameter once — each TP shard, TP-duplicates on tp rank 0 only, the tied copy not at all
        (``param_is_not_shared``) — of Σ g²), reduced over the model-parallel (tp × pp) group; scale
        min(1, max_norm / (norm + 1e-6)) as ``torch.nn.utils.clip_grad_norm_``.
        """
        from megatron.core import parallel_state as ps

        params = [p for p in self.policy.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused in this step's graph: every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        _all_reduce_coalesced([p.grad for p in params if getattr(p, "sequence_parallel", False)], self.tp_group)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.world_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        model = self.policy.model
        if self.layout.pp > 1 and self.layout.tied_embeddings and (model.pre_process or model.post_process):
            dist.all_reduce(model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
        square = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in params:
            if counted_once(p):
                square += p.grad.double().pow(2).sum()
        dist.all_reduce(square, group=ps.get_model_parallel_group())
        norm = float(square.sqrt())
        coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def zero_grad(self) -> None:
        """Drop the policy's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        """One AdamW update of the local shards (dp replicas take identical updates)."""
        self.optimizer.step()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ``metrics_group`` (module docstring)."""
        return all_reduce_cpu(t, self.device, group=self.metrics_group)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """MAX over ``metrics_group``."""
        return all_reduce_cpu(t, self.device, op=dist.ReduceOp.MAX, group=self.metrics_group)

    def extra_metrics(self) -> dict[str, float]:
        """None of its own: {}."""
        return {}


def counted_once(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` counts in whole-model sums (parameter count, gradient norm): not a TP duplicate on tp rank > 0
    (``param_is_not_tensor_parallel_duplicate``) and not the last stage's copy of a tied embedding
    (``param_is_not_shared``, megatron's ``clip_grads`` rule)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)


def _all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` in place over ``group`` with one ``all_reduce`` of their flattened concatenation
    (nothing to do for an empty list: every rank of the group passes the same parameters)."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)
