"""The FSDP2 step engine: how the GRPO step runs on an FSDP2-sharded policy (:class:`FSDPEngine`).

:class:`train_workers.fsdp_worker.FSDPTrainWorker` builds the models and composes this engine with
:class:`train_workers.grpo_step.GRPOStep` (the protocol: :class:`train_workers.step_engine.StepEngine`). What is
FSDP2's own here:

- Gradient reduction. FSDP2 averages gradients over the ranks, so each micro-batch loss is back-propagated times the
  world size, which makes that average a sum of the per-rank sums; the global L2 norm and clipping are
  ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients.
- CPU fast paths (``fast_paths``: the worker turns them on for CPU ranks). The policy stays unsharded and its gradients
  local until the step's last micro-batch, so a step costs one all-gather and one reduce-scatter whatever its
  micro-batch count (gloo over loopback TCP is slow; the price is one unsharded copy of the parameters and gradients
  per rank); the frozen reference policy is a full copy on every rank, run under ``torch.inference_mode``. On GPU,
  FSDP2's defaults: resharded after each forward and backward, the reference sharded like the policy.
- The lean variant of the CPU fast paths (``lean``: the worker turns it on for CPU ranks with
  ``train.activation_checkpointing``, which asks for memory over speed). The policy is resharded after each forward
  and backward as FSDP2 does by default (its full parameters are held one layer at a time, for one all-gather per
  layer per forward, recompute and backward), and its gradients are reduce-scattered after every micro-batch's
  backward, so the rank accumulates its gradient shard instead of a full-size gradient (half the model's size saved at
  two ranks, for one more reduce-scatter per extra micro-batch); the reference policy is sharded like the policy and
  all-gathered layer by layer for each micro-batch's reference forward (half its size saved at two ranks, for one
  all-gather per micro-batch); before each micro-batch and the optimizer step the rank hands its freed heap back to
  the OS (``train_workers.host_memory``: a step's mid-sized tensors otherwise leave free but resident memory behind).
  Results are those of the other paths (``tests/distributed/test_trainer_fast_paths.py``); the saving is measured in
  docs/results.md.
- LoRA (``train.lora``): the reference policy is the policy with its adapters off (``LoraPolicy.adapters_off``), and
  the step reports the adapters' parameter counts and every rank's peak memory (:meth:`FSDPEngine.extra_metrics`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from contract.batches import PackedMicroBatch
from train_workers.host_memory import release_free_heap
from train_workers.sharding import full_tensor
from train_workers.step_engine import all_reduce_cpu, device_inputs, frozen_logprobs, no_grad_logprobs
from train_workers.step_metrics import peak_rss_gib


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor passes through)."""
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPEngine:
    """The :class:`~train_workers.step_engine.StepEngine` of one FSDP2 rank (module docstring).

    Args:
        policy: the sharded :class:`~train_workers.policy.ResponseLogprobModel` (float32 parameters).
        reference: the frozen reference policy (replicated with ``fast_paths`` unless ``lean``, else sharded), or
            None (no reference, or LoRA: the policy with its adapters off).
        optimizer: AdamW over the policy's trainable parameters.
        lora: the :class:`~train_workers.lora.LoraPolicy` with ``train.lora``, else None.
        rank, world_size: this rank and the train group's size. device: this rank's device.
        max_grad_norm: ``train.max_grad_norm``. fast_paths: the CPU fast paths; lean: their lean variant (module
            docstring; ignored without ``fast_paths``).
    """

    pipeline = None  # FSDP2 runs the micro-batches one by one

    def __init__(self, policy, reference, optimizer: torch.optim.Optimizer, lora, rank: int, world_size: int,
                 device: torch.device, max_grad_norm: float, fast_paths: bool, lean: bool = False):
        self.policy, self.reference, self.lora = policy, reference, lora
        self.optimizer = optimizer
        self.rank, self.world_size, self.device = rank, world_size, device
        self.max_grad_norm, self.fast_paths, self.lean = max_grad_norm, fast_paths, fast_paths and lean

    @property
    def has_reference(self) -> bool:
        """A frozen copy, or with LoRA the policy with its adapters off (when the job has ``kl_coef`` > 0)."""
        return self.reference is not None or (self.lora is not None and self.lora.with_reference)

    def inputs(self, mb: PackedMicroBatch) -> tuple:
        """``(input_ids, position_ids, logit_positions, targets)`` of ``mb`` on this rank's device."""
        return device_inputs(mb, self.device)

    def prepare_microbatch(self, last: bool) -> None:
        """With the CPU fast paths, keep the policy unsharded and its gradients local until ``last``; ``lean``
        reshards and reduce-scatters after every micro-batch (and hands freed heap back to the OS first; module
        docstring); otherwise FSDP2's defaults."""
        if not self.fast_paths or not hasattr(self.policy, "set_requires_gradient_sync"):
            return
        if self.lean:
            release_free_heap()
        self.policy.set_requires_gradient_sync(last or self.lean)
        self.policy.set_reshard_after_backward(last or self.lean)

    def policy_forward(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (logprobs [M], entropy [M]) with autograd."""
        return self.policy(*args)

    def behaviour_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The policy's logprobs [n, T] float32 without gradient."""
        return no_grad_logprobs(self.policy, mb, args)

    def reference_logprobs(self, mb: PackedMicroBatch, args: tuple) -> torch.Tensor:
        """The reference policy's logprobs [n, T] float32: the frozen copy (under ``inference_mode`` when
        replicated), or with LoRA the sharded policy with its adapters off. A collective unless replicated."""
        if self.lora is not None:
            with self.lora.adapters_off():
                return frozen_logprobs(self.policy, mb, args, inference=False)
        return frozen_logprobs(self.reference, mb, args, inference=self.fast_paths and not self.lean)

    def reshard_policy(self) -> None:
        """Reshard every FSDP2 module of the policy (after a reference forward outside a step, with LoRA, so the
        policy is left sharded as it was found)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.policy.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss × world_size`` (FSDP2 averages the gradients over the ranks)."""
        (loss * self.world_size).backward()

    def clip_gradients(self) -> float:
        """Clip the policy's gradients to ``max_grad_norm`` (global L2 norm over all ranks, in place) and return the
        norm before clipping; NaN/Inf when any gradient element is (the step is then skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        return float(full_tensor(grad_norm))

    def zero_grad(self) -> None:
        """Drop the policy's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        """One AdamW update (``lean``: after handing freed heap back to the OS, as the first step also allocates
        AdamW's state)."""
        if self.lean:
            release_free_heap()
        self.optimizer.step()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the train group (every rank holds different sequences)."""
        return all_reduce_cpu(t, self.device)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """MAX over the train group."""
        return all_reduce_cpu(t, self.device, op=dist.ReduceOp.MAX)

    def extra_metrics(self) -> dict[str, float]:
        """With ``train.lora`` only (a collective: every rank's peak RSS is summed into its own slot):
        ``actor/trainable_parameters`` and ``actor/trainable_fraction`` (adapters, whole model), every rank's
        ``memory/train_rank<r>_peak_rss_gib`` and rank 0's ``memory/train_optimizer_state_gib`` (its AdamW shards);
        {} without LoRA."""
        if self.lora is None:
            return {}
        rss = torch.zeros(self.world_size, dtype=torch.float64)
        rss[self.rank] = peak_rss_gib()
        rss = all_reduce_cpu(rss, self.device)
        state_bytes = sum(_local(v).numel() * _local(v).element_size() for per_param in self.optimizer.state.values()
                          for v in per_param.values() if isinstance(v, torch.Tensor))
        return {**self.lora.metrics(),
                **{f"memory/train_rank{r}_peak_rss_gib": float(v) for r, v in enumerate(rss)},
                "memory/train_optimizer_state_gib": state_bytes / 2**30}
