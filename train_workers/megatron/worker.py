"""Megatron-core train worker: one rank of a TP × PP × DP layout of the policy (and frozen reference policy).

``MegatronTrainWorker`` implements :class:`contract.train_worker.TrainWorker`; ``TrainPool`` finds it in
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

- Micro-batches. The scheduler splits the batch over ``world_size`` ranks; the ranks of one model replica must run
  the same sequences, so :meth:`MegatronTrainWorker.train_step` first all-gathers the micro-batches of its TP group
  (pp = 1) or of its model-parallel tp × pp group (pp > 1, empty placeholders dropped) with ``all_gather_object``
  (CPU tensors), and every rank of the replica runs all of them. The loss is still each sequence's share of the
  global batch loss (global ``num_tokens``/``num_sequences``), and the metric sums are reduced so each sequence counts
  once: over the data-parallel group at pp = 1 (``FSDPStep._metrics_group``), over the ranks of one tp rank across
  every stage and replica at pp > 1 (only the last stage has loss sums).
- Pipeline parallelism (pp > 1, :mod:`train_workers.megatron.pipeline`): megatron-core's own schedule
  (``get_forward_backward_func()``, 1F1B) owns the forward and backward of all micro-batches; ``forward_step_func``
  returns ``(output, loss_func)`` and the last stage's ``loss_func`` is ``FSDPStep._microbatch_loss`` (the same
  loss, KL, TIS/MIS, NaN flags and metric sums as FSDP2). Reference-policy logprobs (and the behaviour logprobs with
  several iterations or MIS) come from the same schedule with ``forward_only=True``. Every micro-batch of a step is
  right-padded to one [rows, seq_len] shape, as the schedule's p2p communication needs. Transformer layers are split
  evenly (``check_megatron_layout``); with tied embeddings the last stage holds a copy of the embedding as
  ``output_layer.weight``, loaded from the HF embedding.
- Gradients. Parameters are local shards (Megatron's ``ColumnParallelLinear``/``RowParallelLinear``/
  ``VocabParallelEmbedding``, ``megatron/core/tensor_parallel/layers.py``): the TP collectives of the forward and
  backward make each shard's gradient exact, and replicated parameters (the RMSNorm weights) get identical gradients
  on every tp rank — except with ``train.sequence_parallel``, where each tp rank's norm gradients cover its share of
  the sequence and are first summed over the TP group (megatron-core's ``_allreduce_layernorm_grads`` in
  ``megatron/core/distributed/finalize_model_grads.py``). The gradients are then summed over the dp group
  (``all_reduce``), a tied embedding's two copies (pp > 1) summed over Megatron's embedding group, the global L2 norm
  is taken over every parameter once across tp and pp (TP-duplicates counted on tp rank 0 only,
  ``param_is_not_tensor_parallel_duplicate``; the tied copy not at all, ``param_is_not_shared``) and clipped as
  ``torch.nn.utils.clip_grad_norm_`` does.
- Optimizer: ``torch.optim.AdamW`` over the local shards (dp replicas hold identical copies of the state). Megatron's
  ``DistributedDataParallel`` and ``DistributedOptimizer`` are not used: their gradient buffers are allocated on
  ``torch.cuda.current_device()`` and their overlap uses CUDA streams (``megatron/core/distributed/
  param_and_grad_buffer.py``, ``distributed_data_parallel.py``), so they cannot run on CPU, where this backend is
  tested. On GPU they are the next step (ZeRO-1 sharded state, overlapped reduce-scatter); so is the schedule's
  ``finalize_model_grads_func``, which needs them (this worker reduces the gradients itself, above).
- Weight sync and checkpoints (:mod:`train_workers.megatron.sync`, :mod:`train_workers.megatron.checkpoint`): each HF
  tensor is gathered over the TP group of the stage holding it and, at pp > 1, broadcast from that stage over the
  pipeline-parallel group; one tensor at a time, never the whole model on one rank.

Refused for now, each with a :class:`ValueError` naming the field: ``train.sequence_parallel`` together with
``train.pipeline_parallel_size`` > 1, ``train.lora``, ``model.dtype`` float16 (no loss
scaling), and sampling filters at tp > 1 (``policy.py``). Virtual pipeline stages (the interleaved schedule) are not
built.

Precision (``model.dtype``), as the FSDP2 worker's (``train_workers.sharding``): float32 trains in float32. bfloat16
is mixed precision: the GPTModel's parameters, AdamW's state, the gradient clip, checkpoints and the weight-sync
source stay float32 (master weights); each forward runs on bfloat16 casts of them
(:meth:`~train_workers.megatron.policy.MegatronResponseLogprobs.run_model`, ``torch.func.functional_call``) with
``TransformerConfig(bf16=True)`` (attention softmax in float32, bfloat16 activations between pipeline stages); the
gradients arrive as bfloat16 and are accumulated in float32 on the parameters, as FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` does (``to_accumulated_grad_if_needed`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``); the output logits are cast to float32 before the log-softmax,
so logprobs, KL and loss are float32. The frozen reference policy is held in bfloat16. Megatron's own two modes do
not run on CPU (megatron-core 0.16.1): (a) float32 parameters under ``torch.autocast`` (``enable_autocast``;
``pipeline_parallel/schedules.py`` opens ``torch.autocast("cuda")``) fails in the backward on CPU because the
tensor-parallel linear layers' autograd functions use ``custom_fwd``/``custom_bwd(device_type="cuda")``
(``tensor_parallel/layers.py``), so the backward matmul meets a bfloat16 gradient and the float32 saved weight
("expected m1 and m2 to have the same dtype", measured); (b) ``Float16Module`` (bfloat16 parameters) with
``Float16OptimizerWithFloat16Params`` (float32 main parameters) allocates its found-inf and norm buffers on "cuda"
(``optimizer/optimizer.py``, ``optimizer/clip_grads.py``) and would make the parameters that checkpoints and sync
read bfloat16. The cast-per-forward is (b)'s arithmetic (bfloat16 weights in the matmuls, a float32 master copy
updated by AdamW), with the bfloat16 copy made at each forward and freed after its backward (as FSDP2's unsharded
bfloat16 parameters) instead of kept, on CPU and GPU alike.

Sequence parallelism (``train.sequence_parallel``, tp > 1): megatron-core's ``TransformerConfig.sequence_parallel``
(embedding output reduce-scattered by sequence, [S/tp, B, H] between the TP regions, all-gather before and
reduce-scatter after each attention/MLP); the norms are :class:`~train_workers.megatron.config.SequenceParallelRMSNorm`,
the unpacked batch is padded to a multiple of tp and the output layer's input gathered first (``policy.py``).

CPU accommodations that are production behaviour: the causal mask is passed explicitly (``policy.py``), and on CPU
the CUDA RNG tracker is not seeded (``model_parallel_cuda_manual_seed`` needs CUDA); dropout is 0 in these models.
The remaining CUDA assumptions of megatron-core on CPU are bypassed in the test process only
(``tests/megatron_cpu.py``); on GPU the worker runs them unpatched. They are: ``RotaryEmbedding`` moving ``inv_freq``
to ``torch.cuda.current_device()``, which is also where the pipeline's p2p receive buffers are allocated
(``pipeline_parallel/p2p_communication.py`` ``_communicate``); attention's CUDA RNG tracker ``fork()``; the tied
embedding's ``.cuda()`` copy at construction with pp > 1 (``LanguageModule.setup_embeddings_and_output_layer``);
the pipeline schedule's token counter ``torch.zeros([], dtype=torch.int, device="cuda")``
(``forward_backward_pipelining_without_interleaving``, ``pipeline_parallel/schedules.py``); and
``torch.cuda.synchronize()`` after batched p2p (``batch_p2p_sync``, ``p2p_communication.py``).
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
from train_workers.megatron.pipeline import PipelineStep
from train_workers.megatron.sync import MegatronSync
from contract.batches import PackedMicroBatch
from train_workers.sharding import as_dtype


class MegatronTrainWorker(PipelineStep, FSDPStep, MegatronSync):
    """One rank of the Megatron-core train group (constructor arguments: :mod:`contract.train_worker`).

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
        bind_rank(train)  # train.cpu_affinity and train.num_threads, before any torch work
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._use_cuda() else torch.device("cpu")
        self._cpu_fast_paths = False  # FSDP2-only switches (FSDPStep reads it); nothing to unshard here

    @staticmethod
    def refuse_unsupported(train, dtype: str | torch.dtype = "float32") -> None:
        """Raise :class:`ValueError` naming the field for a setting this backend does not build yet (module doc)."""
        if train.sequence_parallel and train.pipeline_parallel_size > 1:
            raise ValueError("train.sequence_parallel=true with train.pipeline_parallel_size > 1: not built yet (the "
                             "pipeline's p2p shape would need the sequence padded to a multiple of tp on every "
                             "stage); use sequence_parallel with pipeline_parallel_size 1")
        if train.lora is not None:
            raise ValueError("train.lora: LoRA is not supported by the megatron backend; use strategy fsdp")
        if as_dtype(dtype) == torch.float16:
            raise ValueError("model.dtype='float16': the megatron backend has no loss scaling; use bfloat16 (mixed "
                             "precision with float32 master weights) or float32")

    @classmethod
    def check_layout(cls, train, model_path: str, dtype: str | torch.dtype = "float32"):
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
        """Join the train process group, build Megatron's parallel state (tp, pp, dp), the policy (from ``policy_path``
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
        self.layout = self.check_layout(self.train, self.model_path, self.dtype)
        ps.initialize_model_parallel(tensor_model_parallel_size=self.layout.tp,
                                     pipeline_model_parallel_size=self.layout.pp)
        if self._use_cuda():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(self.seed)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self._metrics_group = self.dp_group if self.layout.pp == 1 else self._same_tp_rank_group()
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
                             device=str(self.device), node_id=node_id, gpu_ids=gpu_ids,
                             cpu_cores=sorted(os.sched_getaffinity(0)), num_threads=torch.get_num_threads())

    def _build(self, path: str, trainable: bool):
        """A ``GPTModel`` of this rank's shard (its TP slice of its pipeline stage's layers) of the HF folder
        ``path`` (each tensor read from the safetensors files and sliced, ``convert.hf_to_megatron``), wrapped in
        :class:`MegatronResponseLogprobs`. Trainable: float32 parameters computed in ``self.dtype``; frozen (the
        reference policy): parameters in ``self.dtype`` (module docstring, Precision)."""
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt.gpt_model import GPTModel

        from train_workers.megatron.config import gpt_model_kwargs, transformer_config
        from train_workers.megatron.convert import hf_to_megatron
        from train_workers.megatron.hf_io import SafetensorsFolder
        from train_workers.megatron.policy import MegatronResponseLogprobs

        layout = self.layout
        config = transformer_config(layout, compute_dtype=self.dtype, sequence_parallel=self.train.sequence_parallel)
        model = GPTModel(**gpt_model_kwargs(layout, config, parallel_output=True,
                                            pre_process=ps.is_pipeline_first_stage(),
                                            post_process=ps.is_pipeline_last_stage()))
        state = hf_to_megatron(SafetensorsFolder(path), layout, self.tp_rank, self.pp_rank)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{path}: the converted state dict does not match the GPTModel: missing {missing[:3]}, "
                               f"unexpected {list(unexpected)[:3]}")
        model.to(self.device, torch.float32 if trainable else self.dtype)
        model.requires_grad_(trainable)
        model.train(trainable)
        mixed = trainable and self.dtype != torch.float32
        return MegatronResponseLogprobs(model, layout.vocab_size, self.temperature, **self.sampling_filters,
                                        compute_dtype=self.dtype if mixed else None)

    def _same_tp_rank_group(self):
        """The process group of the ranks with this rank's tensor-parallel rank, over every pipeline stage and
        data-parallel replica (a collective: every rank creates every such group). With pp > 1 only the last stage
        has loss sums (the others contribute zeros), so the step's sums reduced over it count each sequence once."""
        from megatron.core import parallel_state as ps

        tp_ranks = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        tp_ranks[self.rank] = ps.get_tensor_model_parallel_rank()
        dist.all_reduce(tp_ranks)
        mine = None
        for t in range(self.layout.tp):
            group = dist.new_group([r for r in range(self.world_size) if int(tp_ranks[r]) == t])
            if t == self.tp_rank:
                mine = group
        return mine

    def _count_parameters(self) -> int:
        """Parameters of the whole model (every shard once, the last stage's copy of a tied embedding not counted):
        a collective over the model-parallel (tp × pp) group."""
        from megatron.core import parallel_state as ps

        local = sum(p.numel() for p in self.policy.parameters() if _counted_once(p))
        total = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=ps.get_model_parallel_group())
        return int(total)

    # ---- training (FSDPStep's loop; the Megatron-specific pieces) -------------------------------------------------
    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int):
        """:meth:`FSDPStep.train_step` over the micro-batches of this rank's whole TP group (module docstring);
        a collective over the train group."""
        return super().train_step(self._replica_microbatches(microbatches), num_tokens, num_sequences)

    def _replica_microbatches(self, microbatches: list[PackedMicroBatch]) -> list[PackedMicroBatch]:
        """Every micro-batch of the ranks of this rank's model replica, in rank order: its TP group at pp = 1
        (tp = 1: ``microbatches``); its model-parallel (tp × pp) group at pp > 1, without the empty placeholders
        (every stage runs the same list, so they are not needed to keep collectives in step)."""
        from megatron.core import parallel_state as ps

        if self.layout.tp * self.layout.pp == 1:
            return list(microbatches)
        group = self.tp_group if self.layout.pp == 1 else ps.get_model_parallel_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [_to_cpu(mb) for mb in microbatches], group=group)
        replica = [mb for share in gathered for mb in share]
        return replica if self.layout.pp == 1 else [mb for mb in replica if mb.num_sequences > 0]

    def _accumulate_locally(self, last: bool) -> None:
        """Gradients stay local until :meth:`_clip_gradients` (nothing to unshard: parameters are Megatron shards)."""

    def _replicate_reference(self) -> bool:
        """The reference policy is a full TP-sharded replica on every dp rank (no FSDP wrapping)."""
        return True

    def _clip_gradients(self) -> float:
        """Sum the gradients over the dp group (and a tied embedding's two copies over the embedding group), clip
        them to ``train.max_grad_norm`` by their global L2 norm and return the norm before clipping (NaN/Inf when any
        gradient element is).

        With sequence parallelism the gradients of the parameters marked ``sequence_parallel`` (the RMSNorm
        weights, ``config.SequenceParallelRMSNorm``) hold only this tp rank's share of the sequence and are first
        summed over the TP group, as megatron-core's ``finalize_model_grads`` (``_allreduce_layernorm_grads``) does.

        ``FSDPStep`` back-propagates ``loss × world_size`` (FSDP2 averages over the world); the dp sum is divided by
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
            if _counted_once(p):
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


def _counted_once(p: torch.nn.Parameter) -> bool:
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


def _to_cpu(mb: PackedMicroBatch) -> PackedMicroBatch:
    """``mb`` with every tensor on the CPU (for ``all_gather_object``)."""
    from dataclasses import fields, replace

    return replace(mb, **{f.name: getattr(mb, f.name).cpu() for f in fields(mb)
                          if isinstance(getattr(mb, f.name), torch.Tensor)})
