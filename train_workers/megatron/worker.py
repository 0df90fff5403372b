"""Megatron-core train worker: one rank of a TP × DP layout of the policy (and frozen reference policy).

``MegatronTrainWorker`` implements :class:`train_workers.base.TrainWorker`; ``TrainPool`` finds it in
``train_workers.registry`` under ``train.strategy: megatron``. Layout: tp = ``train.tensor_parallel_size``, pp =
``train.pipeline_parallel_size``, dp = ``world_size / (tp · pp)`` (derived), built by megatron-core's
``parallel_state.initialize_model_parallel`` over the train process group (gloo on CPU, NCCL on GPU, as FSDP2).
Rank order is Megatron's default ``tp-cp-ep-dp-pp``: the tp ranks of one model replica are consecutive, so a Ray
placement that packs consecutive ranks on a node keeps each TP group on one node.

What is shared with the FSDP2 backend (backend-neutral code reused as is): the train step, loss, NaN/Inf skip,
off-policy correction and metrics (``train_workers.fsdp_step.FSDPStep``: the policy here is
:class:`train_workers.megatron.policy.MegatronResponseLogprobs`, which has ``ResponseLogprobModel``'s signature), the
sync group and bucket streaming (``train_workers.fsdp_sync.FSDPSync``, with Megatron's own tensor sources in
:mod:`train_workers.megatron.sync`). Specific to Megatron:

- Micro-batches. The scheduler splits the batch over ``world_size`` ranks; the tp ranks of one replica must run the
  same sequences, so :meth:`MegatronTrainWorker.train_step` first all-gathers the micro-batches of its TP group
  (``all_gather_object``, CPU tensors) and every rank of the group runs all of them. The loss is still each
  sequence's share of the global batch loss (global ``num_tokens``/``num_sequences``), and the metric sums are
  reduced over the data-parallel group only (``FSDPStep._metrics_group``), so each sequence counts once.
- Gradients. Parameters are local shards (Megatron's ``ColumnParallelLinear``/``RowParallelLinear``/
  ``VocabParallelEmbedding``, ``megatron/core/tensor_parallel/layers.py``): the TP collectives of the forward and
  backward make each shard's gradient exact, and replicated parameters (the RMSNorm weights) get identical gradients
  on every tp rank — except with ``train.sequence_parallel``, where each tp rank's norm gradients cover its share of
  the sequence and are first summed over the TP group (megatron-core's ``_allreduce_layernorm_grads`` in
  ``megatron/core/distributed/finalize_model_grads.py``). The gradients are then summed over the dp group
  (``all_reduce``), the global L2 norm is taken over every parameter once (TP-duplicates counted on tp rank 0 only,
  ``param_is_not_tensor_parallel_duplicate``) and clipped as ``torch.nn.utils.clip_grad_norm_`` does.
- Optimizer: ``torch.optim.AdamW`` over the local shards (dp replicas hold identical copies of the state). Megatron's
  ``DistributedDataParallel`` and ``DistributedOptimizer`` are not used: their gradient buffers are allocated on
  ``torch.cuda.current_device()`` and their overlap uses CUDA streams (``megatron/core/distributed/
  param_and_grad_buffer.py``, ``distributed_data_parallel.py``), so they cannot run on CPU, where this backend is
  tested. On GPU they are the next step (ZeRO-1 sharded state, overlapped reduce-scatter).

Refused for now, each with a :class:`ValueError` naming the field: ``train.pipeline_parallel_size`` > 1 (PP needs
megatron-core's schedule, ``get_forward_backward_func``, to own the forward and backward of all micro-batches with the
loss on the last stage, where this worker reuses ``FSDPStep``'s one-backward-per-micro-batch loop; on CPU the
schedule's ``p2p_communication.py`` also allocates on ``torch.cuda.current_device()`` and, with ``batch_p2p_sync``,
calls ``torch.cuda.synchronize()``; the weight conversion already handles pp), ``train.lora``, and ``model.dtype``
other than float32 (Megatron's mixed precision, ``Float16Module`` with fp32 master weights in its optimizer, is not
wired here); sampling filters at tp > 1 (``policy.py``).

Sequence parallelism (``train.sequence_parallel``, tp > 1): megatron-core's ``TransformerConfig.sequence_parallel``
(embedding output reduce-scattered by sequence, [S/tp, B, H] between the TP regions, all-gather before and
reduce-scatter after each attention/MLP); the norms are :class:`~train_workers.megatron.config.SequenceParallelRMSNorm`,
the unpacked batch is padded to a multiple of tp and the output layer's input gathered first (``policy.py``).

CPU accommodations that are production behaviour: the causal mask is passed explicitly (``policy.py``), and on CPU
the CUDA RNG tracker is not seeded (``model_parallel_cuda_manual_seed`` needs CUDA); dropout is 0 in these models.
The remaining CUDA assumptions of megatron-core on CPU are bypassed in tests only (``tests/megatron_cpu.py``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.messages import TrainRankInfo
from train_workers.fsdp_step import PHASES, FSDPStep
from train_workers.megatron.sync import MegatronSync
from train_workers.packing import PackedMicroBatch
from train_workers.sharding import as_dtype


class MegatronTrainWorker(FSDPStep, MegatronSync):
    """One rank of the Megatron-core train group (constructor arguments: :mod:`train_workers.base`).

    Raises:
        ValueError: at construction, a setting this backend refuses for now (module docstring), naming the field.
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
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self.refuse_unsupported(train, dtype)
        from train_workers.megatron.policy import refuse_vocab_parallel_filters

        refuse_vocab_parallel_filters(train.tensor_parallel_size, **self.sampling_filters)
        if train.num_threads:
            torch.set_num_threads(train.num_threads)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._use_cuda() else torch.device("cpu")
        self._cpu_fast_paths = False  # FSDP2-only switches (FSDPStep reads it); nothing to unshard here

    @staticmethod
    def refuse_unsupported(train, dtype: str = "float32") -> None:
        """Raise :class:`ValueError` naming the field for a setting this backend does not build yet (module doc)."""
        if train.pipeline_parallel_size > 1:
            raise ValueError(f"train.pipeline_parallel_size={train.pipeline_parallel_size}: pipeline parallelism is "
                             "not supported by the megatron backend yet (megatron-core's pipeline schedules need "
                             "CUDA); use 1")
        if train.lora is not None:
            raise ValueError("train.lora: LoRA is not supported by the megatron backend; use strategy fsdp")
        if dtype != "float32":
            raise ValueError(f"model.dtype={dtype!r}: the megatron backend trains in float32 only for now")

    @classmethod
    def check_layout(cls, train, model_path: str, dtype: str = "float32"):
        """Check ``train``'s TP × PP layout against the model folder's ``config.json`` before anything starts.

        Returns:
            the :class:`train_workers.megatron.config.MegatronLayout`.

        Raises:
            ValueError: a refused setting (:meth:`refuse_unsupported`), or a
                :class:`~train_workers.megatron.config.MegatronLayoutError` naming the field (sizes that do not divide
                heads or layers, an unsupported architecture).
        """
        from train_workers.megatron.config import check_megatron_layout, read_hf_config

        cls.refuse_unsupported(train, dtype)
        return check_megatron_layout(read_hf_config(model_path), train.tensor_parallel_size,
                                     train.pipeline_parallel_size)

    def _use_cuda(self) -> bool:
        return torch.cuda.is_available() and self.train.num_gpus_per_worker > 0

    # ---- set-up -------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address."""
        import ray

        from weight_sync.group import free_port

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return ip, free_port(ip)

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> TrainRankInfo:
        """Join the train process group, build Megatron's parallel state (tp, dp), the policy (from ``policy_path``
        or ``model_path``), the frozen reference policy (from ``model_path``, when ``kl_coef`` > 0) and AdamW.

        Raises:
            RuntimeError: the process group did not form within ``train.timeout_s``, or a converted state dict does
                not fill the model (names the missing/unexpected parameters).
            MegatronLayoutError: the layout does not fit the model (``check_layout``).
        """
        from megatron.core import parallel_state as ps

        backend = self.train.backend if self.train.backend != "auto" else ("nccl" if self._use_cuda() else "gloo")
        if self._use_cuda():
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.train.timeout_s),
        )
        torch.manual_seed(self.seed + self.rank)
        self.layout = self.check_layout(self.train, self.model_path, "float32")
        ps.initialize_model_parallel(tensor_model_parallel_size=self.layout.tp,
                                     pipeline_model_parallel_size=self.layout.pp)
        if self._use_cuda():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(self.seed)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self._metrics_group = self.dp_group
        self.policy = self._build(policy_path or self.model_path, trainable=True)
        self.reference = self._build(self.model_path, trainable=False) if self.algorithm.kl_coef > 0 else None
        self.kl_coef = float(self.algorithm.kl_coef)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=self.train.lr,
            betas=tuple(self.train.betas), weight_decay=self.train.weight_decay,
        )
        n_params = self._count_parameters()
        import ray

        node_id, gpu_ids = None, []
        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return TrainRankInfo(rank=self.rank, backend=backend, num_parameters=n_params, pid=os.getpid(),
                             device=str(self.device), node_id=node_id, gpu_ids=gpu_ids)

    def _build(self, path: str, trainable: bool):
        """A ``GPTModel`` of this rank's shard of the HF folder ``path`` (each tensor read from the safetensors
        files and sliced, ``convert.hf_to_megatron``), wrapped in :class:`MegatronResponseLogprobs`."""
        from megatron.core.models.gpt.gpt_model import GPTModel

        from train_workers.megatron.config import gpt_model_kwargs, transformer_config
        from train_workers.megatron.convert import hf_to_megatron
        from train_workers.megatron.hf_io import SafetensorsFolder
        from train_workers.megatron.policy import MegatronResponseLogprobs

        layout = self.layout
        config = transformer_config(layout, sequence_parallel=self.train.sequence_parallel)
        model = GPTModel(**gpt_model_kwargs(layout, config, parallel_output=True))
        state = hf_to_megatron(SafetensorsFolder(path), layout, self.tp_rank, self.pp_rank)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{path}: the converted state dict does not match the GPTModel: missing {missing[:3]}, "
                               f"unexpected {list(unexpected)[:3]}")
        model.to(self.device)
        model.requires_grad_(trainable)
        model.train(trainable)
        return MegatronResponseLogprobs(model, layout.vocab_size, self.temperature, **self.sampling_filters)

    def _count_parameters(self) -> int:
        """Parameters of the whole model (every shard once): a collective over the tensor-parallel group."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        local = sum(p.numel() for p in self.policy.parameters() if param_is_not_tensor_parallel_duplicate(p))
        total = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.tp_group)
        return int(total)

    # ---- training (FSDPStep's loop; the Megatron-specific pieces) -------------------------------------------------
    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int):
        """:meth:`FSDPStep.train_step` over the micro-batches of this rank's whole TP group (module docstring);
        a collective over the train group."""
        return super().train_step(self._replica_microbatches(microbatches), num_tokens, num_sequences)

    def _replica_microbatches(self, microbatches: list[PackedMicroBatch]) -> list[PackedMicroBatch]:
        """Every micro-batch of the ranks of this rank's TP group, in tp-rank order (tp = 1: ``microbatches``)."""
        if self.layout.tp == 1:
            return list(microbatches)
        gathered: list = [None] * self.layout.tp
        dist.all_gather_object(gathered, [_to_cpu(mb) for mb in microbatches], group=self.tp_group)
        return [mb for share in gathered for mb in share]

    def _accumulate_locally(self, last: bool) -> None:
        """Gradients stay local until :meth:`_clip_gradients` (nothing to unshard: parameters are Megatron shards)."""

    def _replicate_reference(self) -> bool:
        """The reference policy is a full TP-sharded replica on every dp rank (no FSDP wrapping)."""
        return True

    def _clip_gradients(self) -> float:
        """Sum the gradients over the dp group, clip them to ``train.max_grad_norm`` by their global L2 norm and
        return the norm before clipping (NaN/Inf when any gradient element is).

        With sequence parallelism the gradients of the parameters marked ``sequence_parallel`` (the RMSNorm
        weights, ``config.SequenceParallelRMSNorm``) hold only this tp rank's share of the sequence and are first
        summed over the TP group, as megatron-core's ``finalize_model_grads`` (``_allreduce_layernorm_grads``) does.

        ``FSDPStep`` back-propagates ``loss × world_size`` (FSDP2 averages over the world); the dp sum is divided by
        ``world_size`` so the gradient is that of the batch loss. Norm: sqrt(Σ over every parameter, each shard once,
        of Σ g²), reduced over the model-parallel group; scale min(1, max_norm / (norm + 1e-6)) as
        ``torch.nn.utils.clip_grad_norm_``.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

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
        square = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                square += p.grad.double().pow(2).sum()
        dist.all_reduce(square, group=ps.get_model_parallel_group())
        norm = float(square.sqrt())
        coef = min(1.0, self.train.max_grad_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Write the policy as an HF folder and the AdamW state in HF names under ``path``
        (:mod:`train_workers.megatron.checkpoint`); a collective; returns ``{"seconds"}``."""
        from train_workers.megatron.checkpoint import save_checkpoint

        t0 = time.perf_counter()
        save_checkpoint(self, path)
        return {"seconds": time.perf_counter() - t0}

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Restore the AdamW state saved by :meth:`save_checkpoint` into this rank's shards and continue at
        ``policy_version``; returns ``{field: (saved, in use)}`` for changed hyperparameters.

        Raises:
            FileNotFoundError: the optimizer files are missing. ValueError: they name unknown parameters.
        """
        from train_workers.megatron.checkpoint import load_optimizer_state

        changed = load_optimizer_state(self, path)
        self.policy_version = int(policy_version)
        return changed

    def shutdown(self) -> None:
        """Leave Megatron's parallel state and the train process group."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` in place over ``group`` with one ``all_reduce`` of their flattened concatenation
    (nothing to do for an empty list: every rank of the group passes the same parameters)."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def _to_cpu(mb: PackedMicroBatch) -> PackedMicroBatch:
    """``mb`` with every tensor on the CPU (for ``all_gather_object``)."""
    from dataclasses import fields, replace

    return replace(mb, **{f.name: getattr(mb, f.name).cpu() for f in fields(mb)
                          if isinstance(getattr(mb, f.name), torch.Tensor)})
