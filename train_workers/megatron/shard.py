"""This rank's shard of a Megatron-core ``GPTModel`` — its TP slice of its pipeline stage's layers — built from an
HF folder for :class:`train_workers.megatron.worker.MegatronTrainWorker` (the policy, trainable, and the frozen
reference policy), and the two layout collectives its set-up needs: the group of the ranks sharing its tensor-parallel
rank, and the whole model's parameter count.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from train_workers.megatron.engine import counted_once


def build_shard(ctx, layout, tp_rank: int, pp_rank: int, path: str, trainable: bool):
    """A ``GPTModel`` of this rank's shard (TP rank ``tp_rank`` of pipeline stage ``pp_rank`` of ``layout``, a
    :class:`train_workers.megatron.config.MegatronLayout`) of the HF folder ``path`` (each tensor read from the
    safetensors files and sliced, ``convert.hf_to_megatron``), wrapped in
    :class:`~train_workers.megatron.policy.MegatronResponseLogprobs`, on ``ctx.device`` (``ctx``: the rank's
    :class:`~train_workers.rank_context.RankContext`). Trainable: float32 parameters computed in ``ctx.dtype``;
    frozen (the reference policy): parameters in ``ctx.dtype`` (module docstring, Precision).

    Raises:
        RuntimeError: the converted state dict does not fill the model (names the missing/unexpected parameters).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from train_workers.megatron.config import gpt_model_kwargs, transformer_config
    from train_workers.megatron.convert import hf_to_megatron
    from train_workers.megatron.hf_io import SafetensorsFolder
    from train_workers.megatron.policy import MegatronResponseLogprobs

    dtype = ctx.dtype
    config = transformer_config(layout, compute_dtype=dtype, sequence_parallel=ctx.train.sequence_parallel)
    model = GPTModel(**gpt_model_kwargs(layout, config, parallel_output=True,
                                        pre_process=ps.is_pipeline_first_stage(),
                                        post_process=ps.is_pipeline_last_stage()))
    state = hf_to_megatron(SafetensorsFolder(path), layout, tp_rank, pp_rank)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: the converted state dict does not match the GPTModel: missing {missing[:3]}, "
                           f"unexpected {list(unexpected)[:3]}")
    model.to(ctx.device, torch.float32 if trainable else dtype)
    model.requires_grad_(trainable)
    model.train(trainable)
    mixed = trainable and dtype != torch.float32
    return MegatronResponseLogprobs(model, layout.vocab_size, ctx.temperature, **ctx.sampling_filters,
                                    compute_dtype=dtype if mixed else None,
                                    entropy_grad=trainable and ctx.algorithm.entropy_coef > 0)


def same_tp_rank_group(ctx, layout, tp_rank: int):
    """The process group of the ranks with tensor-parallel rank ``tp_rank`` (this rank's), over every pipeline stage
    and data-parallel replica (a collective: every rank creates every such group). With pp > 1 only the last stage
    has loss sums (the others contribute zeros), so the step's sums reduced over it count each sequence once."""
    from megatron.core import parallel_state as ps

    world_size = ctx.world_size
    tp_ranks = torch.zeros(world_size, dtype=torch.int64, device=ctx.device)
    tp_ranks[ctx.rank] = ps.get_tensor_model_parallel_rank()
    dist.all_reduce(tp_ranks)
    mine = None
    for t in range(layout.tp):
        group = dist.new_group([r for r in range(world_size) if int(tp_ranks[r]) == t])
        if t == tp_rank:
            mine = group
    return mine


def count_parameters(policy: torch.nn.Module, device: torch.device) -> int:
    """Parameters of the whole model (every shard once, the last stage's copy of a tied embedding not counted):
    a collective over the model-parallel (tp × pp) group, on ``device``."""
    from megatron.core import parallel_state as ps

    local = sum(p.numel() for p in policy.parameters() if counted_once(p))
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    return int(total)
