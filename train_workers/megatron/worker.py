"""Megatron-core train worker: one rank of a TP × PP × DP layout of the policy (and frozen reference policy).

``MegatronTrainWorker`` implements :class:`contract.train_worker.TrainWorker`; ``TrainPool`` finds it in
``train_workers.registry`` under ``train.strategy: megatron``. Layout: tp = ``train.tensor_parallel_size``, pp =
``train.pipeline_parallel_size``, dp = ``world_size / (tp · pp)`` (derived), built by megatron-core's
``parallel_state.initialize_model_parallel`` over the train process group (gloo on CPU, NCCL on GPU, as FSDP2).
Rank order is Megatron's default ``tp-cp-ep-dp-pp``: the tp ranks of one model replica are consecutive, so a Ray
placement that packs consecutive ranks on a node keeps each TP group on one node.

The worker is composed of parts, each with one role, as the FSDP2 worker is (no part inherits another backend's
code): the rank's settings and shared set-up (``train_workers.rank_context.RankContext``, ``self.ctx``); the
backend-neutral GRPO step (``train_workers.grpo_step.GRPOStep``, ``self.step``: loss, KL, TIS/MIS, NaN/Inf skip,
metrics; the policy here is :class:`train_workers.megatron.policy.MegatronResponseLogprobs`, which has
``ResponseLogprobModel``'s signature) over the Megatron step engine
(:class:`train_workers.megatron.engine.MegatronEngine`, ``self.engine``); the neutral weight sender
(``train_workers.weight_sender.WeightSender``, ``self.sender``) over Megatron's own tensor source
(:class:`train_workers.megatron.sync.MegatronSyncSource`). Specific to Megatron:

- Micro-batches. The scheduler splits the batch over ``world_size`` ranks; the ranks of one model replica must run
  the same sequences, so :meth:`MegatronTrainWorker.train_step` first all-gathers the micro-batches of its TP group
  (pp = 1) or of its model-parallel tp × pp group (pp > 1, empty placeholders dropped) with ``all_gather_object``
  (CPU tensors), and every rank of the replica runs all of them. The loss is still each sequence's share of the
  global batch loss (global ``num_tokens``/``num_sequences``), and the metric sums are reduced so each sequence counts
  once: over the data-parallel group at pp = 1, over the ranks of one tp rank across every stage and replica at
  pp > 1 (only the last stage has loss sums): the engine's ``metrics_group``.
- Pipeline parallelism (pp > 1, :mod:`train_workers.megatron.pipeline`): megatron-core's own schedule
  (``get_forward_backward_func()``, 1F1B) owns the forward and backward of all micro-batches; ``forward_step_func``
  returns ``(output, loss_func)`` and the last stage's ``loss_func`` is the GRPO step's micro-batch loss (the same
  loss, KL, TIS/MIS, NaN flags and metric sums as FSDP2). Reference-policy logprobs (and the behaviour logprobs with
  several iterations or MIS) come from the same schedule with ``forward_only=True``. Every micro-batch of a step is
  right-padded to one [rows, seq_len] shape, as the schedule's p2p communication needs. Transformer layers are split
  evenly (``check_megatron_layout``); with tied embeddings the last stage holds a copy of the embedding as
  ``output_layer.weight``, loaded from the HF embedding.
- Gradients: reduced over dp (and the tied embedding's copies), normed and clipped by the engine
  (:meth:`MegatronEngine.clip_gradients`, its module docstring).
- Optimizer: ``torch.optim.AdamW`` over the local shards (dp replicas hold identical copies of the state). Megatron's
  ``DistributedDataParallel`` and ``DistributedOptimizer`` are not used: their gradient buffers are allocated on
  ``torch.cuda.current_device()`` and their overlap uses CUDA streams (``megatron/core/distributed/
  param_and_grad_buffer.py``, ``distributed_data_parallel.py``), so they cannot run on CPU, where this backend is
  tested. On GPU they are the next step (ZeRO-1 sharded state, overlapped reduce-scatter); so is the schedule's
  ``finalize_model_grads_func``, which needs them (the engine reduces the gradients itself, above).
- Weight sync and checkpoints (:mod:`train_workers.megatron.sync`, :mod:`train_workers.megatron.checkpoint`): each HF
  tensor is gathered over the TP group of the stage holding it and, at pp > 1, broadcast from that stage over the
  pipeline-parallel group; one tensor at a time, never the whole model on one rank.

Refused for now, each with a :class:`ValueError` naming the field: ``train.sequence_parallel`` together with
``train.pipeline_parallel_size`` > 1, ``train.lora``, ``model.dtype`` float16 (no loss
scaling), and sampling filters at tp > 1 (``policy.py``). Virtual pipeline stages (the interleaved schedule) are not
built.

Precision (``model.dtype``): :mod:`train_workers.megatron.shard`, which builds the models.

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

import time
from functools import partial

import torch
import torch.distributed as dist

from contract.batches import PackedMicroBatch
from contract.messages import TrainRankInfo, TrainResult
from contract.sync_reports import SendReport
from train_workers.grpo_step import GRPOStep
from train_workers.megatron.engine import MegatronEngine
from train_workers.megatron.pipeline import MegatronPipeline
from train_workers.megatron.shard import build_shard, count_parameters, same_tp_rank_group
from train_workers.megatron.sync import MegatronSyncSource
from train_workers.rank_context import RankContext, node_address, sync_node_id
from train_workers.sharding import as_dtype
from train_workers.weight_sender import WeightSender


class MegatronTrainWorker:
    """One rank of the Megatron-core train group (constructor arguments: :mod:`contract.train_worker` and
    :class:`~train_workers.rank_context.RankContext`).

    Attributes:
        ctx: the rank's settings. policy_version: the trainer's policy version.
        policy, reference, optimizer: the models, built by :meth:`init_distributed` (None before).
        layout, tp_rank, pp_rank, tp_group, dp_group, pp_group: the Megatron layout and this rank's place in it.
        engine, step: the composed step parts (module docstring), built by :meth:`init_distributed`.
        sender: the weight sender; without a source until :meth:`init_distributed` builds one over Megatron's
            tensors (:class:`MegatronSyncSource`), so a sync call made before fails with the sender's own errors.

    Raises:
        ValueError: at construction, a setting this backend refuses for now (module docstring), naming the field.
    """

    def __init__(self, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
                 max_response_tokens: int, dtype: str = "float32", seed: int = 0,
                 sampling_filters: dict | None = None, model_source=None):
        from train_workers.megatron.policy import refuse_vocab_parallel_filters

        self.refuse_unsupported(train, dtype)
        refuse_vocab_parallel_filters(train.tensor_parallel_size, **(sampling_filters or {}))
        self.ctx = RankContext.create(rank, world_size, model_path, train, algorithm, temperature,
                                      max_response_tokens, dtype, seed, sampling_filters, model_source)
        self.policy_version = 0
        self.policy = self.reference = self.optimizer = self.layout = None
        self.engine: MegatronEngine | None = None
        self.step: GRPOStep | None = None
        self.sender = WeightSender(self.ctx.rank, self.ctx.device, self.ctx.use_cuda)  # no source: see init_distributed

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

    # ---- set-up -------------------------------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address."""
        return node_address()

    def init_distributed(self, master_addr: str, master_port: int, policy_path: str | None = None) -> TrainRankInfo:
        """Join the train process group, build Megatron's parallel state (tp, pp, dp), the policy (from ``policy_path``
        or ``model_path``), the frozen reference policy (from ``model_path``, when ``kl_coef`` > 0) and AdamW, and
        compose the engine, the GRPO step and the weight sender.

        Raises:
            RuntimeError: the process group did not form within ``train.timeout_s``, or a converted state dict does
                not fill the model (names the missing/unexpected parameters).
            MegatronLayoutError: the layout does not fit the model (``check_layout``).
        """
        from megatron.core import parallel_state as ps

        ctx = self.ctx
        backend = ctx.join_train_group(master_addr, master_port)
        self.layout = self.check_layout(ctx.train, ctx.model_path, ctx.dtype)
        ps.initialize_model_parallel(tensor_model_parallel_size=self.layout.tp,
                                     pipeline_model_parallel_size=self.layout.pp)
        if ctx.use_cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(ctx.seed)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        metrics_group = self.dp_group if self.layout.pp == 1 else same_tp_rank_group(ctx, self.layout, self.tp_rank)
        shard = partial(build_shard, ctx, self.layout, self.tp_rank, self.pp_rank)
        self.policy = shard(policy_path or ctx.model_path, trainable=True)
        self.reference = shard(ctx.model_path, trainable=False) if ctx.algorithm.kl_coef > 0 else None
        self.optimizer = ctx.adamw(self.policy)
        pipeline = MegatronPipeline(self.policy, self.reference, ctx.device, ctx.world_size) \
            if self.layout.pp > 1 else None
        self.engine = MegatronEngine(self.policy, self.reference, self.optimizer, ctx.world_size, ctx.device,
                                     ctx.train.max_grad_norm, self.layout, self.tp_group, self.dp_group,
                                     metrics_group, pipeline)
        self.step = GRPOStep(self.engine, ctx.algorithm, ctx.train, ctx.max_response_tokens)
        self.sender = WeightSender(ctx.rank, ctx.device, ctx.use_cuda, MegatronSyncSource(
            self.policy.model, ctx.model_path, self.layout, self.pp_rank, self.tp_group, self.pp_group))
        return ctx.rank_info(backend, count_parameters(self.policy, ctx.device))

    # ---- training (train_workers.grpo_step over train_workers.megatron.engine) ----------------------------------
    def set_lr(self, lr: float) -> None:
        """Train the following steps at learning rate ``lr`` (:meth:`GRPOStep.set_lr`; its ValueError)."""
        self.step.set_lr(lr)

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (:meth:`GRPOStep.set_kl_coef`).

        Raises:
            ValueError: ``kl_coef`` is negative or not finite, or > 0 without a reference policy.
        """
        self.step.set_kl_coef(kl_coef)

    def train_step(self, microbatches: list[PackedMicroBatch], num_tokens: int, num_sequences: int) -> TrainResult:
        """:meth:`GRPOStep.train_step` over the micro-batches of this rank's whole model replica (module docstring);
        a collective over the train group. The policy version advances when an update was applied."""
        result = self.step.train_step(self._replica_microbatches(microbatches), num_tokens, num_sequences,
                                      self.policy_version)
        self.policy_version = result.policy_version
        return result

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

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """Reference-policy logprobs [n, T] float32 of one packed micro-batch (0 at padding) on every rank; None
        without a reference policy. A collective over the TP group; at pp > 1 through the pipeline, the last stage
        broadcasting the result over the pipeline-parallel group (a collective over the model-parallel group)."""
        engine = self.engine
        if not engine.has_reference:
            return None
        if engine.pipeline is None:
            return engine.reference_logprobs(mb, engine.inputs(mb))
        if mb.num_sequences == 0:
            return torch.zeros(mb.response_mask.shape, dtype=torch.float32)
        out = engine.pipeline.logprobs(engine.pipeline.prepare([mb]), reference=True)[0]
        if out is None:
            out = torch.empty(mb.response_mask.shape, dtype=torch.float32, device=self.ctx.device)
        last = dist.get_global_rank(self.pp_group, self.layout.pp - 1)
        dist.broadcast(out, src=last, group=self.pp_group)
        return out

    # ---- weight sync (train_workers.weight_sender over train_workers.megatron.sync) -------------------------------
    def sync_plan(self, engine_dtype: str, bucket_bytes: int) -> list:
        """The bucket plan of the policy's parameters in HF names and order (:class:`MegatronSyncSource`) in
        ``engine_dtype`` (:meth:`WeightSender.plan`).

        Raises:
            ValueError: an unknown dtype name.
        """
        return self.sender.plan(engine_dtype, bucket_bytes)

    def sync_adapter_config(self) -> dict | None:
        """None: this backend has no LoRA, the engines receive full weights."""
        return None

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
        """Stream the policy to every engine, bucket by bucket (all train ranks call this together: each tensor is
        gathered over its stage's TP group and broadcast over the pipeline; :meth:`WeightSender.send`).

        Raises:
            RuntimeError: called before ``sync_plan``/``init_sync_group``, or the transport failed.
        """
        return self.sender.send(verify, self.policy_version)

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


def _to_cpu(mb: PackedMicroBatch) -> PackedMicroBatch:
    """``mb`` with every tensor on the CPU (for ``all_gather_object``)."""
    from dataclasses import fields, replace

    return replace(mb, **{f.name: getattr(mb, f.name).cpu() for f in fields(mb)
                          if isinstance(getattr(mb, f.name), torch.Tensor)})
