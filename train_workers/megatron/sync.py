"""HF-named full tensors from a Megatron TP layout, one parameter at a time: the weight-sync sources and the
checkpoint writer of :class:`train_workers.megatron.worker.MegatronTrainWorker`.

:class:`HFGatherer` turns local Megatron tensors (parameters, or AdamW moments of the same shapes) into HF tensors:
asked for an HF name, it all-gathers the one Megatron parameter holding it from the TP ranks (a collective over the
tensor-parallel group; replicated tensors are taken locally) and converts it with
``convert.megatron_param_to_hf``; the siblings of a fused parameter (k and v after q of ``linear_qkv``, up after gate
of ``linear_fc1``) are kept until asked for. So a rank holds at most one gathered Megatron parameter beyond its shards,
never the whole model. Every rank of the train group must ask for the same names in the same order.

:class:`MegatronSync` plugs this into ``train_workers.fsdp_sync.FSDPSync``: the bucket plan lists the HF names in the
HF model's own ``named_parameters()`` order with HF shapes, in the engine dtype — the very plan the FSDP2 backend makes
(``weight_sync.buckets.plan_buckets``) — and ``broadcast_weights`` streams it through ``weight_sync.sender``
unchanged, with the same checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from train_workers.fsdp_sync import FSDPSync
from train_workers.megatron.config import MegatronLayout
from train_workers.megatron.convert import global_layer_name, megatron_param_to_hf


def hf_parameter_order(model_path: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the HF model's parameters in ``named_parameters()`` order (tied weights once), read from
    ``config.json`` on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


class HFGatherer:
    """HF name → full HF tensor, from this rank's Megatron tensors (module docstring).

    Args:
        tensors: stage-local Megatron name → this rank's tensor (a parameter's shard or a same-shaped moment).
        tensor_parallel: Megatron name → whether the tensor is split over the TP ranks (else replicated).
        layout: the model's layout. pp_rank: this rank's pipeline stage. tp_group: the tensor-parallel group.
        cast: applied to each HF tensor before it is returned (e.g. the engine dtype).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], tensor_parallel: Mapping[str, bool],
                 layout: MegatronLayout, pp_rank: int, tp_group, cast: Callable[[torch.Tensor], torch.Tensor] = None):
        self.tensors, self.tensor_parallel, self.layout = tensors, tensor_parallel, layout
        self.pp_rank, self.tp_group = pp_rank, tp_group
        self.cast = cast or (lambda t: t)
        self.source: dict[str, str] = {}  # HF name → local Megatron name
        for name, t in tensors.items():
            meta = [torch.empty(t.shape, dtype=t.dtype, device="meta")] * layout.tp
            for hf_name, _ in megatron_param_to_hf(global_layer_name(name, layout, pp_rank), meta, layout):
                self.source[hf_name] = name
        self._pending: dict[str, torch.Tensor] = {}

    def __call__(self, hf_name: str) -> torch.Tensor:
        """The full HF tensor ``hf_name``; a collective over the TP group unless a sibling gather left it pending.

        Raises:
            KeyError: ``hf_name`` comes from no local tensor.
        """
        if hf_name in self._pending:
            return self._pending.pop(hf_name)
        name = self.source[hf_name]
        local = self.tensors[name].detach().contiguous()
        shards = [local]
        if self.tensor_parallel[name] and self.layout.tp > 1:
            shards = [torch.empty_like(local) for _ in range(self.layout.tp)]
            dist.all_gather(shards, local, group=self.tp_group)
        gname = global_layer_name(name, self.layout, self.pp_rank)
        for out_name, t in megatron_param_to_hf(gname, shards, self.layout):
            self._pending[out_name] = self.cast(t)
        return self._pending.pop(hf_name)


def parameter_gatherer(worker, cast=None) -> HFGatherer:
    """:class:`HFGatherer` over the worker's policy parameters (``worker.policy.model``, a ``GPTModel``)."""
    params = dict(worker.policy.model.named_parameters())
    split = {name: bool(getattr(p, "tensor_model_parallel", False)) for name, p in params.items()}
    return HFGatherer(params, split, worker.layout, worker.pp_rank, worker.tp_group, cast)


class MegatronSync(FSDPSync):
    """Weight-sync methods of the Megatron worker: ``FSDPSync`` with HF-named sources gathered from TP shards."""

    def _sync_sources(self) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """``(HF name, HF shape, gather)`` in the HF model's parameter order; ``gather()`` (a collective over the TP
        group) returns the full tensor in the ``sync_plan`` engine dtype.

        Raises:
            RuntimeError: the Megatron parameters do not cover exactly the HF model's parameters.
        """
        gather = parameter_gatherer(self, cast=lambda t: t.to(self._engine_dtype))
        order = hf_parameter_order(self.model_path)
        if {name for name, _ in order} != set(gather.source):
            raise RuntimeError(f"Megatron parameters map to {sorted(set(gather.source) ^ {n for n, _ in order})[:4]} "
                               f"differently from the HF model {self.model_path}")
        return [(name, shape, lambda name=name: gather(name)) for name, shape in order]
