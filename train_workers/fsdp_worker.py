"""FSDP2 train worker: one data-parallel rank of the policy (and frozen reference policy).

``FSDPTrainWorker`` is a plain class implementing :class:`contract.train_worker.TrainWorker`; ``TrainPool`` finds it in
``train_workers.registry`` under ``train.strategy: fsdp`` and wraps it with ``ray.remote`` (resources from the spec).
All ranks call every collective method together: FSDP collectives (all-gather, reduce-scatter) need every rank.

The class is split by role: this file builds the rank (process group, sharded policy, reference policy, optimizer)
and saves/loads checkpoints; ``train_workers.fsdp_step`` holds the train step (loss, clipping, NaN/Inf skip) and
``train_workers.fsdp_sync`` the weight-sync sender.

LoRA (``train.lora``, ``train_workers.lora``): the policy is the base model wrapped with PEFT adapters before
sharding; only the adapters are in AdamW and get gradients; the reference policy is the same module with the adapters
off (``self.reference`` stays None, ``self._lora`` says so); checkpoints are adapter folders
(``train_workers.lora_checkpoint``); the engines receive the merged weights.

Model parallel layout (torchtitan's order, ``train_workers.sharding``): ``fully_shard`` on each decoder layer, then on
the root (:class:`ResponseLogprobModel`, which owns the embedding, final norm and the tied LM head).

Precision: with ``model.dtype`` float32 everything is float32. With bfloat16/float16 the policy trains in FSDP2 mixed
precision (``sharding.shard_mixed_precision``): float32 parameters and AdamW state, forward/backward in ``model.dtype``,
gradients reduced in ``train.reduce_dtype``; the frozen reference policy (no optimizer) is held in ``model.dtype``.
Weight sync casts the float32 parameters to the engine's dtype; checkpoints hold the float32 parameters.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from contract.messages import TrainRankInfo
from train_workers.cpu_affinity import bind_rank
from train_workers.fsdp_step import PHASES, FSDPStep
from train_workers.fsdp_sync import FSDPSync
from train_workers.packing import packed_attention
from train_workers.policy import ResponseLogprobModel
from train_workers.sharding import as_dtype, mixed_precision_policy, shard_model


class FSDPTrainWorker(FSDPStep, FSDPSync):
    """One rank of the FSDP2 data-parallel train group.

    Args:
        rank, world_size: this rank and the number of train ranks.
        model_path: local HF folder of the initial policy (also the reference policy).
        train: the spec's ``TrainSpec``; algorithm: ``AlgorithmSpec``.
        temperature: sampling temperature (logprobs are recomputed at it).
        sampling_filters: the rollout's ``{"top_k", "top_p", "min_p"}`` (policy, old-policy and reference logprobs
            are computed under them, as the engine's are); None: off.
        max_response_tokens: for the Dr. GRPO ``seq-mean-token-sum-norm`` aggregation.
        dtype: the compute dtype name (``model.dtype``): float32, or bfloat16/float16 for mixed precision with
            float32 parameters and AdamW state.
        seed: torch seed for this rank.
    """

    def __init__(self, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
                 max_response_tokens: int, dtype: str = "float32", seed: int = 0,
                 sampling_filters: dict | None = None):
        self.rank, self.world_size = rank, world_size
        self.model_path, self.train, self.algorithm = model_path, train, algorithm
        self.temperature, self.max_response_tokens = temperature, max_response_tokens
        self.sampling_filters = dict(sampling_filters or {})
        self.dtype = as_dtype(dtype)
        self.seed = seed
        self.policy_version = 0
        self._phase_s = dict.fromkeys(PHASES, 0.0)  # seconds per train-step phase, reset by every train_step
        bind_rank(train)  # train.cpu_affinity and train.num_threads, before any torch work
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._use_cuda() else torch.device("cpu")
        # CPU (gloo over loopback TCP, memory to spare): a replicated reference policy and one all-gather +
        # one reduce-scatter per step; GPU: FSDP2's memory-saving defaults. Tests flip it to compare both.
        self._cpu_fast_paths = self.device.type == "cpu"

    def _use_cuda(self) -> bool:
        return torch.cuda.is_available() and self.train.num_gpus_per_worker > 0

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
        import ray

        from weight_sync.group import free_port

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return ip, free_port(ip)

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> TrainRankInfo:
        """Join the train process group, build and shard the policy, reference policy and optimizer.

        ``policy_path`` (a checkpoint's HF folder, on resume) initialises the policy; the reference policy always
        comes from ``model_path`` (the job's initial model).

        Returns:
            this rank's :class:`TrainRankInfo` (Ray node and GPU ids read from the worker itself when under Ray).
        """
        from transformers import AutoModelForCausalLM

        backend = self.train.backend if self.train.backend != "auto" else ("nccl" if self._use_cuda() else "gloo")
        if self._use_cuda():
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.train.timeout_s),
        )
        torch.manual_seed(self.seed + self.rank)

        attention = packed_attention(self._use_cuda(), self.dtype)
        # The policy's parameters (and so AdamW's state) are float32; only its compute runs in self.dtype.
        mp_policy = mixed_precision_policy(self.dtype, self.train.reduce_dtype)
        lora = self.train.lora

        def load(trainable: bool) -> ResponseLogprobModel:
            full = trainable and lora is None  # a LoRA policy's base is model_path; its adapters come from the ckpt
            path = (policy_path or self.model_path) if full else self.model_path
            dtype = torch.float32 if trainable else self.dtype
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
            hf.to(self.device)
            hf.config.use_cache = False
            if trainable and lora is not None:
                hf = self._add_adapters(hf, lora, policy_path)  # only the adapters require grad
            else:
                hf.requires_grad_(trainable)
            model = ResponseLogprobModel(hf, self.temperature, **self.sampling_filters)
            model.train(trainable)
            if trainable or not self._replicate_reference():
                # CPU: unsharded from the first forward to the last backward of a step (see _accumulate_locally)
                shard_model(model, mp_policy=mp_policy if trainable else None,
                            reshard_after_forward=not self._cpu_fast_paths)
            return model

        self.policy = load(True)
        with_reference = self.algorithm.kl_coef > 0
        # LoRA: the reference policy is the policy with its adapters off (train_workers.lora), never a second copy
        self.reference = load(False) if with_reference and lora is None else None
        if lora is not None:
            from train_workers.lora import LoraPolicy

            self._lora = LoraPolicy(self.policy.model, with_reference)
        self.kl_coef = float(self.algorithm.kl_coef)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=self.train.lr,
            betas=tuple(self.train.betas), weight_decay=self.train.weight_decay,
        )
        n_params = sum(p.numel() for p in self.policy.parameters())
        import ray

        node_id, gpu_ids = None, []
        if ray.is_initialized():  # where this rank really runs, read from the worker itself
            node_id = ray.get_runtime_context().get_node_id()
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return TrainRankInfo(rank=self.rank, backend=backend, num_parameters=n_params, pid=os.getpid(),
                             device=str(self.device), node_id=node_id, gpu_ids=gpu_ids,
                             cpu_cores=sorted(os.sched_getaffinity(0)), num_threads=torch.get_num_threads())

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Write the policy (float32 parameters, an HF folder; with ``train.lora`` a PEFT adapter folder instead) and
        the AdamW state to ``path`` (all ranks call it; layout and dtypes: ``train_workers.checkpoint_io`` and
        ``train_workers.lora_checkpoint``); returns ``{"seconds"}``."""
        from train_workers.checkpoint_io import save_checkpoint
        from train_workers.lora_checkpoint import save_lora_checkpoint

        t0 = time.perf_counter()
        save = save_lora_checkpoint if self._lora is not None else save_checkpoint
        save(self.policy, self.optimizer, self.rank, path)
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
