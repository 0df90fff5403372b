"""The tensors an FSDP2 train rank streams to the engines: :class:`FSDPSyncSource`, the FSDP2
:class:`~train_workers.weight_sender.SyncSource` of :class:`train_workers.weight_sender.WeightSender`.

Each tensor is the policy's float32 (master) parameter gathered from its shards (``full_tensor``, a collective over the
train group) and cast to the engine's dtype, under the HF checkpoint name (tied weights once). With ``train.lora`` and
``sync: merged`` the engines receive the merged weights ``W + (alpha/r)·B·A`` under the model's own names
(``train_workers.lora``), so they need no change; with ``sync: adapter`` they receive only the ``lora_A``/``lora_B``
tensors under PEFT's saved names and serve them as a vLLM LoRA adapter (``rollout_workers.vllm.extension``).
"""

from __future__ import annotations

import torch

from train_workers.lora import MergeRounding
from train_workers.sharding import full_tensor
from train_workers.weight_sender import Source


class FSDPSyncSource:
    """The engine-bound tensors of an FSDP2 policy (module docstring).

    Args:
        policy: the (sharded) :class:`~train_workers.policy.ResponseLogprobModel`.
        lora: the policy's :class:`~train_workers.lora.LoraPolicy` with ``train.lora``, else None.
        adapter_sync: ``train.lora.sync`` is ``adapter`` (the engines receive the adapter tensors only).
    """

    def __init__(self, policy, lora=None, adapter_sync: bool = False):
        self.policy, self.lora, self.adapter_sync = policy, lora, adapter_sync and lora is not None
        self._rounding: MergeRounding | None = None  # the merged tensors of the last sources() call

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters in HF checkpoint names (tied weights once), in a fixed order."""
        return list(self.policy.model.named_parameters())

    @staticmethod
    def tensor(param: torch.Tensor, engine_dtype: torch.dtype) -> torch.Tensor:
        """The whole of one parameter (a collective over the train group) as the engine holds it: the float32
        (master) parameter cast to ``engine_dtype``."""
        return full_tensor(param.detach()).to(engine_dtype)

    def sources(self, engine_dtype: torch.dtype) -> list[Source]:
        """``(HF name, shape, gather)`` of every tensor the engines receive, in plan order; ``gather()`` (a
        collective) returns the whole tensor in ``engine_dtype``. With ``train.lora``: ``sync: merged``, the base
        weights with the adapters merged in (``LoraPolicy.merged_sources``, measuring the rounding of the update:
        :meth:`merge_rounding`), under the same names as without LoRA;
        ``sync: adapter``, the adapter tensors only (``LoraPolicy.adapter_sources``, PEFT's saved names)."""
        if self.adapter_sync:
            return [(name, shape, lambda f=f: f().to(engine_dtype)) for name, shape, f in self.lora.adapter_sources()]
        if self.lora is not None:
            self._rounding = MergeRounding()
            return self.lora.merged_sources(engine_dtype, self._rounding)
        return [(name, tuple(p.shape), lambda p=p: self.tensor(p, engine_dtype))
                for name, p in self.named_parameters()]

    def merge_rounding(self) -> tuple[float, float] | None:
        """With ``train.lora.sync: merged``, (relative error, update error) of the LoRA update in the tensors gathered
        since the last :meth:`sources` call (a sync gathers each once: ``train_workers.lora.MergeRounding``); None
        otherwise, or while the update is 0."""
        r = self._rounding
        if r is None or r.relative_error is None:
            return None
        return r.relative_error, r.update_error

    def adapter_config(self) -> dict | None:
        """With ``train.lora.sync: adapter``, the policy's PEFT ``adapter_config.json`` as a dict
        (``LoraPolicy.adapter_config``); None otherwise."""
        return self.lora.adapter_config() if self.adapter_sync else None
