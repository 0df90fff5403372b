"""HF-named full tensors from a Megatron TP × PP layout, one parameter at a time: the weight-sync source and the
checkpoint writer of :class:`train_workers.megatron.worker.MegatronTrainWorker`.

:class:`HFGatherer` turns local Megatron tensors (parameters, or AdamW moments of the same shapes) into HF tensors:
asked for an HF name, the pipeline stage holding it (``convert.hf_stage``) all-gathers the one Megatron parameter
holding it from its TP ranks (a collective over the tensor-parallel group; replicated tensors are taken locally) and
converts it with ``convert.megatron_param_to_hf``; the siblings of a fused parameter (k and v after q of
``linear_qkv``, up after gate of ``linear_fc1``) are kept until asked for. With pp > 1 that stage then broadcasts the
HF tensor over the pipeline-parallel group (``dist.broadcast``, in the tensors' own dtype, before any cast), so every
rank — train rank 0, the sender, included — returns it. So a rank holds at most one gathered Megatron parameter
beyond its shards, never the whole model. Every rank of the train group must ask for the same names in the same order.

:class:`MegatronSyncSource` is the Megatron :class:`~train_workers.weight_sender.SyncSource` of the neutral
:class:`train_workers.weight_sender.WeightSender`: the bucket plan lists the HF names in the HF model's own
``named_parameters()`` order with HF shapes, in the engine dtype — the very plan the FSDP2 backend makes
(``weight_sync.buckets.plan_buckets``) — and the sender streams it through ``weight_sync.sender`` unchanged, with the
same checksums.

The functions that take a ``worker`` read a Megatron rank's ``policy`` (its ``GPTModel`` is ``policy.model``),
``ctx.model_path``, ``layout``, ``pp_rank``, ``tp_group`` and ``pp_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from train_workers.megatron.config import MegatronLayout
from train_workers.megatron.convert import global_layer_name, hf_stage, megatron_param_to_hf
from train_workers.weight_sender import Source


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
        pp_group: the pipeline-parallel group (needed when ``layout.pp`` > 1).
        hf_shapes: HF name → shape of every HF tensor (``hf_parameter_order``; needed when ``layout.pp`` > 1: the
            other stages receive tensors they do not hold).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], tensor_parallel: Mapping[str, bool],
                 layout: MegatronLayout, pp_rank: int, tp_group, cast: Callable[[torch.Tensor], torch.Tensor] = None,
                 pp_group=None, hf_shapes: Mapping[str, tuple[int, ...]] | None = None):
        if layout.pp > 1 and (pp_group is None or hf_shapes is None):
            raise ValueError(f"pipeline_parallel_size={layout.pp}: HFGatherer needs pp_group and hf_shapes")
        self.tensors, self.tensor_parallel, self.layout = tensors, tensor_parallel, layout
        self.pp_rank, self.tp_group, self.pp_group, self.hf_shapes = pp_rank, tp_group, pp_group, hf_shapes
        self.cast = cast or (lambda t: t)
        self.source: dict[str, str] = {}  # HF name → local Megatron name
        for name, t in tensors.items():
            meta = [torch.empty(t.shape, dtype=t.dtype, device="meta")] * layout.tp
            for hf_name, _ in megatron_param_to_hf(global_layer_name(name, layout, pp_rank), meta, layout):
                self.source[hf_name] = name
        first = next(iter(tensors.values()))
        self._dtype, self._device = first.dtype, first.device  # what another stage's tensors arrive as
        self._pending: dict[str, torch.Tensor] = {}

    def __call__(self, hf_name: str) -> torch.Tensor:
        """The full HF tensor ``hf_name``: a collective over the TP group of its stage unless a sibling gather left
        it pending, then (pp > 1) a broadcast from that stage over the pipeline-parallel group.

        Raises:
            KeyError: ``hf_name`` comes from no local tensor (pp = 1) or from no stage (pp > 1).
        """
        if self.layout.pp == 1:
            return self.cast(self._local(hf_name))
        stage = hf_stage(hf_name, self.layout)
        if stage == self.pp_rank:
            full = self._local(hf_name).contiguous()
        else:
            full = torch.empty(self.hf_shapes[hf_name], dtype=self._dtype, device=self._device)
        dist.broadcast(full, src=dist.get_global_rank(self.pp_group, stage), group=self.pp_group)
        return self.cast(full)

    def _local(self, hf_name: str) -> torch.Tensor:
        """The HF tensor ``hf_name`` from this stage's tensors (uncast); a collective over the TP group unless a
        sibling gather left it pending."""
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
            self._pending[out_name] = t
        return self._pending.pop(hf_name)


def tensor_gatherer(worker, tensors: Mapping[str, torch.Tensor], cast=None) -> HFGatherer:
    """:class:`HFGatherer` over ``tensors`` (stage-local Megatron name → the parameter or a same-shaped AdamW moment
    of ``worker.policy.model``, a ``GPTModel``), with the worker's groups."""
    return _gatherer(worker.policy.model, worker.ctx.model_path, worker.layout, worker.pp_rank, worker.tp_group,
                     worker.pp_group, tensors, cast)


def parameter_gatherer(worker, cast=None) -> HFGatherer:
    """:class:`HFGatherer` over the worker's policy parameters (``worker.policy.model``, a ``GPTModel``)."""
    return tensor_gatherer(worker, dict(worker.policy.model.named_parameters()), cast)


def _gatherer(model, model_path: str, layout: MegatronLayout, pp_rank: int, tp_group, pp_group,
              tensors: Mapping[str, torch.Tensor], cast) -> HFGatherer:
    """:class:`HFGatherer` over ``tensors`` of ``model`` (a ``GPTModel``: which of them are TP-split)."""
    params = dict(model.named_parameters())
    split = {name: bool(getattr(params[name], "tensor_model_parallel", False)) for name in tensors}
    shapes = dict(hf_parameter_order(model_path)) if layout.pp > 1 else None
    return HFGatherer(tensors, split, layout, pp_rank, tp_group, cast, pp_group=pp_group, hf_shapes=shapes)


class MegatronSyncSource:
    """The engine-bound tensors of a Megatron policy: its parameters gathered whole under HF names (module docstring).

    Args:
        model: this rank's ``GPTModel`` (``policy.model``). model_path: the HF folder whose parameter order and names
            the plan follows. layout: the model's layout. pp_rank: this rank's pipeline stage. tp_group, pp_group:
            Megatron's tensor- and pipeline-parallel groups.
    """

    #: Full weights only: this backend has no LoRA (``train_workers.weight_sender.SyncSource``).
    adapter_sync = False

    def __init__(self, model, model_path: str, layout: MegatronLayout, pp_rank: int, tp_group, pp_group):
        self.model, self.model_path, self.layout = model, model_path, layout
        self.pp_rank, self.tp_group, self.pp_group = pp_rank, tp_group, pp_group

    def merge_rounding(self) -> None:
        """None: nothing is merged (no LoRA in this backend)."""
        return None

    def sources(self, engine_dtype: torch.dtype) -> list[Source]:
        """``(HF name, HF shape, gather)`` in the HF model's parameter order; ``gather()`` (a collective over the TP
        group, and with pp > 1 over the pipeline-parallel group) returns the full tensor in ``engine_dtype`` on every
        rank.

        Raises:
            RuntimeError: this stage's Megatron parameters do not cover exactly its share of the HF model's
                parameters (``convert.hf_stage``).
        """
        gather = _gatherer(self.model, self.model_path, self.layout, self.pp_rank, self.tp_group, self.pp_group,
                           dict(self.model.named_parameters()), cast=lambda t: t.to(engine_dtype))
        order = hf_parameter_order(self.model_path)
        mine = {name for name, _ in order if hf_stage(name, self.layout) == self.pp_rank}
        if mine != set(gather.source):
            raise RuntimeError(f"Megatron parameters of stage {self.pp_rank} map to "
                               f"{sorted(set(gather.source) ^ mine)[:4]} differently from the HF model "
                               f"{self.model_path}")
        return [(name, shape, lambda name=name: gather(name)) for name, shape in order]
