"""FSDP2 train worker: one data-parallel rank of the policy (and frozen reference policy).

``FSDPTrainWorker`` is a plain class implementing :class:`contract.train_worker.TrainWorker`; ``TrainPool`` finds it in
``train_workers.registry`` under ``train.strategy: fsdp`` and wraps it with ``ray.remote`` (resources from the spec).
All ranks call every collective method together: FSDP collectives (all-gather, reduce-scatter) need every rank.

The worker is composed of parts, each with one role: the rank's settings and shared set-up
(``train_workers.rank_context.RankContext``, ``self.ctx``); this file builds the models (process group, sharded
policy, reference policy, optimizer) and saves/loads checkpoints; the FSDP2 step engine
(``train_workers.fsdp_engine.FSDPEngine``, ``self.engine``) runs them for the backend-neutral GRPO step
(``train_workers.grpo_step.GRPOStep``, ``self.step``); weight sync is the neutral sender
(``train_workers.weight_sender.WeightSender``, ``self.sender``) over the FSDP2 tensors
(``train_workers.fsdp_sync.FSDPSyncSource``, ``self.sender.source``).

LoRA (``train.lora``, ``train_workers.lora``): the policy is the base model wrapped with PEFT adapters before
sharding; only the adapters are in AdamW and get gradients; the reference policy is the same module with the adapters
off (``self.reference`` stays None, ``self._lora`` says so); checkpoints are adapter folders
(``train_workers.lora_checkpoint``); the engines receive the merged weights.

Model parallel layout (torchtitan's order, ``train_workers.sharding``): ``fully_shard`` on each decoder layer, then on
the root (:class:`ResponseLogprobModel`, which owns the embedding, final norm and the tied LM head).

Memory (``train.activation_checkpointing``, ``train.cpu_offload``): the policy's decoder layers recompute their
activations in the backward (transformers' non-reentrant gradient checkpointing, inside each FSDP2 unit; FSDP2
unshards a layer again for its recompute; on CPU ranks it also turns on the lean variant of the CPU fast paths,
``train_workers.fsdp_engine``); with CPU offload FSDP2 keeps the sharded parameters, gradients and the
AdamW state on the CPU (``CPUOffloadPolicy``) and the optimizer steps there. The frozen reference policy has no
backward and no optimizer: neither applies to it.

Precision: with ``model.dtype`` float32 everything is float32. With bfloat16/float16 the policy trains in FSDP2 mixed
precision (``sharding.shard_mixed_precision``): float32 parameters and AdamW state, forward/backward in ``model.dtype``,
gradients reduced in ``train.reduce_dtype``; the frozen reference policy (no optimizer) is held in ``model.dtype``.
Weight sync casts the float32 parameters to the engine's dtype; checkpoints hold the float32 parameters.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from contract.batches import PackedMicroBatch
from contract.messages import TrainRankInfo, TrainResult
from contract.model_source import ModelSource
from contract.sync_reports import SendReport
from train_workers.fsdp_engine import FSDPEngine
from train_workers.fsdp_sync import FSDPSyncSource
from train_workers.grpo_step import GRPOStep
from train_workers.packing import packed_attention
from train_workers.policy import ResponseLogprobModel
from train_workers.rank_context import RankContext, node_address, sync_node_id
from train_workers.sharding import mixed_precision_policy, shard_model
from train_workers.weight_sender import WeightSender


class FSDPTrainWorker:
    """One rank of the FSDP2 data-parallel train group (constructor arguments: :mod:`contract.train_worker` and
    :class:`~train_workers.rank_context.RankContext`).

    Attributes:
        ctx: the rank's settings. policy_version: the trainer's policy version.
        policy, reference, optimizer: the models, built by :meth:`init_distributed` (None before).
        engine, step: the composed step parts (module docstring), built by :meth:`init_distributed`.
        sender: the weight sender; without a source until :meth:`init_distributed` builds one over the policy's
            tensors (:class:`FSDPSyncSource`), so a sync call made before fails with the sender's own errors.
    """

    def __init__(self, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
                 max_response_tokens: int, dtype: str = "float32", seed: int = 0,
                 sampling_filters: dict | None = None, model_source: ModelSource | None = None):
        self.ctx = RankContext.create(rank, world_size, model_path, train, algorithm, temperature,
                                      max_response_tokens, dtype, seed, sampling_filters, model_source)
        self.policy_version = 0
        # CPU (gloo over loopback TCP, memory to spare): a replicated reference policy and one all-gather +
        # one reduce-scatter per step; GPU: FSDP2's memory-saving defaults. Tests flip it to compare both.
        self._cpu_fast_paths = self.ctx.device.type == "cpu"
        # Their lean variant (FSDPEngine: the policy resharded per micro-batch, gradient shards accumulated, the
        # reference sharded) when the job asks for memory over speed with activation checkpointing.
        self._cpu_lean = self._cpu_fast_paths and train.activation_checkpointing
        self.policy = self.reference = self.optimizer = None
        self._lora = None  # train_workers.lora.LoraPolicy when train.lora is set
        self.engine: FSDPEngine | None = None
        self.step: GRPOStep | None = None
        self.sender = WeightSender(self.ctx.rank, self.ctx.device, self.ctx.use_cuda)  # no source: see init_distributed

    @staticmethod
    def _add_adapters(hf, lora, policy_path: str | None):
        """``hf`` wrapped with ``train.lora``'s adapters (PEFT, unsharded); on resume (``policy_path``, a LoRA
        checkpoint) the adapters are the checkpoint's."""
        from train_workers.lora import add_adapters
        from train_workers.lora_checkpoint import load_adapters

        peft_model = add_adapters(hf, lora)
        if policy_path is not None:
            load_adapters(peft_model, policy_path, lora)
        return peft_model

    # ---- set-up -------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address."""
        return node_address()

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> TrainRankInfo:
        """Join the train process group, build and shard the policy, reference policy and optimizer, and compose
        the engine, the GRPO step and the weight sender.

        ``policy_path`` (a checkpoint's HF folder, on resume) initialises the policy; the reference policy always
        comes from ``model_path`` (the job's initial model).

        Returns:
            this rank's :class:`TrainRankInfo` (Ray node and GPU ids read from the worker itself when under Ray).
        """
        from transformers import AutoModelForCausalLM

        ctx, train = self.ctx, self.ctx.train
        backend = ctx.join_train_group(master_addr, master_port)
        attention = packed_attention(ctx.use_cuda, ctx.dtype)
        # The policy's parameters (and so AdamW's state) are float32; only its compute runs in ctx.dtype.
        mp_policy = mixed_precision_policy(ctx.dtype, train.reduce_dtype)
        lora = train.lora
        fast, lean = self._cpu_fast_paths, self._cpu_fast_paths and self._cpu_lean

        def load(trainable: bool) -> ResponseLogprobModel:
            full = trainable and lora is None  # a LoRA policy's base is model_path; its adapters come from the ckpt
            path = (policy_path or ctx.model_path) if full else ctx.model_path
            dtype = torch.float32 if trainable else ctx.dtype
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention,
                                                      **ctx.source.hf_kwargs(path))
            hf.to(ctx.device)
            hf.config.use_cache = False
            if trainable and train.activation_checkpointing:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if trainable and lora is not None:
                hf = self._add_adapters(hf, lora, policy_path)  # only the adapters require grad
            else:
                hf.requires_grad_(trainable)
            model = ResponseLogprobModel(hf, ctx.temperature, **ctx.sampling_filters)
            model.train(trainable)
            if trainable or not fast or lean:  # the CPU fast paths replicate the frozen reference, unless lean
                # CPU fast paths: unsharded from a step's first forward to its last backward, unless lean (FSDPEngine)
                shard_model(model, mp_policy=mp_policy if trainable else None,
                            reshard_after_forward=not (fast and trainable) or lean,
                            cpu_offload=trainable and train.cpu_offload)
            return model

        self.policy = load(True)
        with_reference = ctx.algorithm.kl_coef > 0
        # LoRA: the reference policy is the policy with its adapters off (train_workers.lora), never a second copy
        self.reference = load(False) if with_reference and lora is None else None
        if lora is not None:
            from train_workers.lora import LoraPolicy

            self._lora = LoraPolicy(self.policy.model, with_reference)
        self.optimizer = ctx.adamw(self.policy)
        self.engine = FSDPEngine(self.policy, self.reference, self.optimizer, self._lora, ctx.rank, ctx.world_size,
                                 ctx.device, train.max_grad_norm, fast_paths=fast, lean=lean)
        self.step = GRPOStep(self.engine, ctx.algorithm, train, ctx.max_response_tokens)
        self.sender = WeightSender(ctx.rank, ctx.device, ctx.use_cuda, FSDPSyncSource(
            self.policy, self._lora, lora is not None and lora.sync == "adapter"))
        return ctx.rank_info(backend, sum(p.numel() for p in self.policy.parameters()))

    # ---- training (train_workers.grpo_step) -----------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Train the following steps at learning rate ``lr`` (:meth:`GRPOStep.set_lr`; the loop's schedule).

        Raises:
            ValueError: ``lr`` is negative or not finite.
        """
        self.step.set_lr(lr)

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (:meth:`GRPOStep.set_kl_coef`).

        Raises:
            ValueError: ``kl_coef`` is negative or not finite, or > 0 without a reference policy.
        """
        self.step.set_kl_coef(kl_coef)

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> TrainResult:
        """:meth:`GRPOStep.train_step` over this rank's micro-batches; a collective over the train group. The policy
        version advances when an update was applied."""
        result = self.step.train_step(microbatches, num_tokens, num_sequences, self.policy_version)
        self.policy_version = result.policy_version
        return result

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """Reference-policy logprobs [n, T] float32 of one packed micro-batch (0 at padding); None when the job has
        no reference policy (``kl_coef`` 0). A collective on GPU (the reference policy is sharded there) and with
        LoRA, where the reference policy is the sharded policy run with its adapters off; the policy is left sharded
        as it was found (a train step instead keeps it gathered for the policy's own forward)."""
        out = self.engine.reference_logprobs(mb, self.engine.inputs(mb)) if self.engine.has_reference else None
        if self._lora is not None:
            self.engine.reshard_policy()
        return out

    # ---- weight sync (train_workers.weight_sender) -----------------------------------------------------------------
    def sync_plan(self, engine_dtype: str, bucket_bytes: int) -> list:
        """The bucket plan of the policy's tensors (:class:`FSDPSyncSource`) in ``engine_dtype``
        (:meth:`WeightSender.plan`).

        Raises:
            ValueError: an unknown dtype name.
        """
        return self.sender.plan(engine_dtype, bucket_bytes)

    def sync_adapter_config(self) -> dict | None:
        """With ``train.lora.sync: adapter``, the policy's PEFT ``adapter_config.json`` as a dict; None otherwise."""
        return self.sender.source.adapter_config() if self.sender.source is not None else None

    def sync_node_id(self) -> str | None:
        """This rank's Ray node id (``sync.mode: auto`` compares it with the engines'); None outside Ray."""
        return sync_node_id()

    def init_sync_group(self, host: str, port: int, world_size: int, timeout_s: float,
                        transport: str = "broadcast") -> dict | None:
        """Rank 0 hosts the weight-sync group and its transport (:meth:`WeightSender.init_group`); returns the
        descriptor the engines join with (rank 0), None on other ranks.

        Raises:
            RuntimeError: called before :meth:`sync_plan`.
        """
        return self.sender.init_group(host, port, world_size, timeout_s, transport)

    def close_sync_group(self) -> None:
        """Tear down this rank's side of the weight-sync group."""
        self.sender.close_group()

    def broadcast_weights(self, verify: bool | list[str]) -> SendReport:
        """Stream the policy to every engine, bucket by bucket (all train ranks call this together;
        :meth:`WeightSender.send`).

        Raises:
            RuntimeError: called before ``sync_plan``/``init_sync_group``, or the transport failed.
        """
        return self.sender.send(verify, self.policy_version)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Write the policy (float32 parameters, an HF folder; with ``train.lora`` a PEFT adapter folder instead) and
        the AdamW state to ``path`` (all ranks call it; layout and dtypes: ``train_workers.checkpoint_io`` and
        ``train_workers.lora_checkpoint``); returns ``{"seconds"}``."""
        from train_workers.checkpoint_io import save_checkpoint
        from train_workers.lora_checkpoint import save_lora_checkpoint

        t0 = time.perf_counter()
        save = save_lora_checkpoint if self._lora is not None else save_checkpoint
        save(self.policy, self.optimizer, self.ctx.rank, path)
        return {"seconds": time.perf_counter() - t0}

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Restore the AdamW moments and step saved by :meth:`save_checkpoint` (the policy weights were loaded by
        ``init_distributed(policy_path=path)``) and continue at ``policy_version``; the hyperparameters stay this
        run's (its spec's), so ``actor/lr`` is the lr in use (``checkpoint_io.load_optimizer_state``).

        Returns:
            ``{field: (saved value, value in use)}`` for every optimizer field that differs from the checkpoint (the
            driver logs them in one line).

        Raises:
            FileNotFoundError: the optimizer files are missing. ValueError: they name unknown parameters.
        """
        from train_workers.checkpoint_io import load_optimizer_state

        changed = load_optimizer_state(self.policy, self.optimizer, path)
        self.policy_version = int(policy_version)
        return changed

    def shutdown(self) -> None:
        """Leave the train process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
