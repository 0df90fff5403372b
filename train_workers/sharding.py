"""FSDP2 sharding of a policy, with mixed precision: float32 parameters and optimizer state, low-precision compute.

Layout (torchtitan's order): ``fully_shard`` on each decoder layer, then on the root. The root is a
:class:`train_workers.policy.ResponseLogprobModel` (it owns the embedding, final norm and tied LM head) or a bare HF
``*ForCausalLM``.

Mixed precision (FSDP2's ``MixedPrecisionPolicy``): the sharded parameters — what the optimizer updates, what
checkpoints and weight sync read — stay float32 ("master weights"); each all-gather casts them to ``compute_dtype``,
so forward and backward run in it, and gradients are reduce-scattered in ``reduce_dtype`` and land on the float32
shards. Without it (pure bfloat16 parameters and a bfloat16 AdamW) an update smaller than half a bfloat16 ulp of the
weight rounds away: at 0.05 the ulp is 2⁻¹² ≈ 2.4e-4, so AdamW's first step of size lr = 5e-6 is lost.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (a torch dtype passes through).

    Raises:
        ValueError: a name outside :data:`DTYPES`.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def mixed_precision_policy(compute_dtype: str | torch.dtype, reduce_dtype: str | torch.dtype = "float32"):
    """FSDP2's ``MixedPrecisionPolicy`` for float32 parameters computed in ``compute_dtype``, gradients reduced in
    ``reduce_dtype``; None when both are float32 (plain float32 training needs no policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute, reduce = as_dtype(compute_dtype), as_dtype(reduce_dtype)
    if compute == torch.float32 and reduce == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute, reduce_dtype=reduce)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor-sharded) parameter, gradient or optimizer state; a plain tensor passes
    through. For a DTensor this is a collective over its mesh: every rank of the train group must call it."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a :class:`ResponseLogprobModel` (``model.model``) or of a bare HF causal LM."""
    hf = model if hasattr(model, "get_decoder") else model.model
    return hf.get_decoder().layers


def shard_model(model: nn.Module, *, mp_policy=None, mesh=None, reshard_after_forward: bool = True,
                cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (in place); returns ``model``.

    Args:
        mp_policy: a ``MixedPrecisionPolicy`` (:func:`mixed_precision_policy`) or None (compute in the parameters'
            dtype).
        mesh: a 1-D device mesh; None: the default process group's.
        reshard_after_forward: FSDP2's option (False keeps the parameters unsharded between forward and backward).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (``train.cpu_offload``): the sharded parameters and their
            gradients live in CPU memory (pinned when CUDA is available), each unit's parameters are copied to the
            device for its forward and backward, and an optimizer built afterwards keeps its state on the CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": offload,
              "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_mixed_precision(model: nn.Module, compute_dtype: str | torch.dtype = "bfloat16",
                          reduce_dtype: str | torch.dtype = "float32", *, mesh=None,
                          reshard_after_forward: bool = True) -> nn.Module:
    """Build a mixed-precision FSDP2 model: cast ``model``'s parameters to float32 (the master weights) and shard it
    with :func:`mixed_precision_policy` (``compute_dtype`` forward/backward, ``reduce_dtype`` gradient reduction).

    The default process group must exist (``torch.distributed.init_process_group``; gloo on CPU, NCCL on GPU).
    Build the optimizer afterwards from ``model.parameters()``: they are the float32 shards, so AdamW's moments are
    float32 too. Outputs come in the dtype the module computes them in (``ResponseLogprobModel``'s logprobs are
    float32 whatever the compute dtype).

    Returns:
        ``model``, sharded in place.

    Raises:
        ValueError: an unknown dtype name.
    """
    model.to(torch.float32)
    return shard_model(model, mp_policy=mixed_precision_policy(compute_dtype, reduce_dtype), mesh=mesh,
                       reshard_after_forward=reshard_after_forward)
