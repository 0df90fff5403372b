"""What the control plane calls on one train rank: the :class:`TrainWorker` protocol every train backend implements.

A backend (``train_workers.fsdp_worker.FSDPTrainWorker``, ``train_workers.megatron.worker.MegatronTrainWorker``) is a
plain class; the Ray shell's ``cluster.ray_shell.train_pool.TrainPool`` picks it from ``train_workers.registry`` by
the spec's ``train.strategy``, wraps it in ``ray.remote`` and starts ``train.world_size`` of them (the in-process
runtime's ``LocalTrainer`` builds one rank in the calling process). Collective methods (marked below) must be called
on every rank together, with the same arguments where noted, or the ranks deadlock until ``train.timeout_s``.

Construction (positional, as ``TrainPool`` calls it)::

    Backend(rank, world_size, model_path, train, algorithm, temperature, max_response_tokens, dtype, seed,
            sampling_filters=None, model_source=None)

``rank``/``world_size``: this rank and the number of train ranks; ``model_path``: local HF folder of the initial
policy (also the reference policy); ``train``: the spec's ``TrainSpec``; ``algorithm``: its ``AlgorithmSpec``;
``temperature``: the rollout's sampling temperature (logprobs are recomputed at it); ``max_response_tokens``: for the
Dr. GRPO aggregation; ``dtype``: ``model.dtype`` (compute dtype name); ``seed``: torch seed base;
``sampling_filters``: ``{"top_k", "top_p", "min_p"}`` of the rollout, or None; ``model_source``: a
:class:`contract.model_source.ModelSource` (``model.revision``, ``model.trust_remote_code``) every load of the model
uses, or None (defaults). The constructor builds nothing
collective; :meth:`TrainWorker.init_distributed` does.

Notation: n sequences in a micro-batch, T their longest response (tokens).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from contract.messages import TrainRankInfo, TrainResult
from contract.sync_reports import SendReport
from contract.batches import PackedMicroBatch


@runtime_checkable
class TrainWorker(Protocol):
    """One rank of a data-parallel train group (policy, frozen reference policy, optimizer, weight-sync sender)."""

    policy_version: int
    """The trainer's policy version: 0 at start (or the checkpoint's), +1 per step that applied an update."""

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free TCP port on it). Rank 0's answer is the train group's rendezvous address and the
        weight-sync group's host."""
        ...

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> TrainRankInfo:
        """Collective. Join the train process group at ``master_addr:master_port``, then build and shard the policy,
        the reference policy (when ``algorithm.kl_coef`` > 0) and the optimizer.

        Args:
            policy_path: a checkpoint's HF folder (on resume) to initialise the policy from; the reference policy
                always comes from ``model_path``. With ``train.lora`` the policy is ``model_path`` wrapped with LoRA
                adapters, taken from ``policy_path`` (a LoRA checkpoint) on resume, and the reference policy is the
                policy with its adapters off (no second copy).

        Returns:
            where this rank runs and what it built (:class:`contract.messages.TrainRankInfo`).

        Raises:
            RuntimeError: the process group did not form within ``train.timeout_s`` (torch.distributed's error).
        """
        ...

    # ---- training -------------------------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Set the optimizer's learning rate for the following train steps; every rank gets the same value (the
        loop's ``train.lr_schedule``).

        Raises:
            ValueError: ``lr`` is negative or not finite.
        """
        ...

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β (``kl_coef``, dimensionless) for the following train steps; every rank gets the same value.

        Raises:
            ValueError: ``kl_coef`` is negative or not finite, or > 0 without a reference policy (spec kl_coef 0).
        """
        ...

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> TrainResult:
        """Collective. ``algorithm.num_iterations`` optimizer steps over this rank's packed micro-batches (every rank
        passes as many; placeholders keep the counts equal).

        Args:
            microbatches: this rank's share of the batch (``train_workers.packing``).
            num_tokens: loss tokens (``response_mask`` ones) over the whole batch, all ranks.
            num_sequences: sequences with at least one loss token over the whole batch, all ranks.

        Returns:
            the step's :class:`contract.messages.TrainResult`, identical on every rank: the policy version after the
            step, whether and why an update was skipped (NaN/Inf loss or gradient norm on any rank; the weights
            and optimizer state are then unchanged), and the numeric ``actor/*``, ``rollout/logprob_diff``,
            ``perf/train_tokens``, ``timing/*``, ``memory/*`` metrics.
        """
        ...

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """Collective when the reference policy is sharded. The frozen reference policy's logprobs of ``mb``'s
        response tokens: [n, T] float32, natural log, under the rollout's temperature and sampling filters; 0 where
        ``mb.response_mask`` is 0. None when the job has no reference policy (``kl_coef`` 0)."""
        ...

    # ---- weight sync ----------------------------------------------------------------------------------------------
    def sync_plan(self, engine_dtype: str, bucket_bytes: int) -> list:
        """The bucket plan (``weight_sync.buckets.Bucket`` list) of the policy's parameters in HF names (with
        ``train.lora``, ``sync: merged``: the base weights with the adapters merged in, under the same names;
        ``sync: adapter``: only the ``lora_A``/``lora_B`` tensors, under PEFT's saved names), cast to
        ``engine_dtype`` (``float32``/``bfloat16``/``float16``), each bucket at most ``bucket_bytes`` bytes unless
        one tensor is larger; identical on every rank.

        Raises:
            ValueError: an unknown dtype name.
        """
        ...

    def sync_adapter_config(self) -> dict | None:
        """With ``train.lora`` and ``sync: adapter``: the policy's PEFT ``adapter_config.json`` (a dict), which the
        engines write next to each streamed adapter; None otherwise (the engines receive full weights)."""
        ...

    def sync_node_id(self) -> str | None:
        """This rank's Ray node id (``sync.mode: auto`` compares it with the engines'); None outside Ray."""
        ...

    def init_sync_group(self, host: str, port: int, world_size: int, timeout_s: float,
                        transport: str = "broadcast") -> dict | None:
        """Rank 0 hosts the weight-sync group (train rank 0 + every engine worker, ``world_size`` members) and the
        sender of ``transport`` (``broadcast``, ``shm`` or ``cuda_ipc``); other ranks do nothing.

        Returns:
            the transport descriptor the engines join with (rank 0), None on other ranks.

        Raises:
            RuntimeError: called before :meth:`sync_plan`, or the group did not form within ``timeout_s`` seconds.
        """
        ...

    def close_sync_group(self) -> None:
        """Tear down this rank's side of the weight-sync group (idempotent)."""
        ...

    def broadcast_weights(self, verify: bool | list[str]) -> SendReport:
        """Collective. Stream the policy to every engine of the sync group, bucket by bucket, in the engine dtype.

        Args:
            verify: True to CRC-32 every tensor, False none, or the tensor names to check.

        Returns:
            the rank's :class:`contract.sync_reports.SendReport` (bytes, checksums and memory are rank 0's).

        Raises:
            RuntimeError: called before :meth:`sync_plan`/:meth:`init_sync_group`, or the transport failed (the
                group is then closed and must be rebuilt).
        """
        ...

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Collective. Write the policy (float32 parameters, an HF folder; with ``train.lora`` a PEFT adapter folder
        instead) and this rank's optimizer state under ``path``; returns ``{"seconds": wall seconds}``."""
        ...

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Restore the optimizer state saved by :meth:`save_checkpoint` (the policy weights came in through
        ``init_distributed(policy_path=path)``) and continue at ``policy_version``.

        Returns:
            ``{field: (saved value, value in use)}`` for every optimizer hyperparameter the spec changed.

        Raises:
            FileNotFoundError: the optimizer files are missing. ValueError: they name unknown parameters.
        """
        ...

    def shutdown(self) -> None:
        """Leave the train process group (the actor is killed afterwards)."""
        ...
