"""Checkpoints of the Megatron backend: an HF folder plus the AdamW state, both in HF names.

Layout of ``path`` (the FSDP2 backend's, ``train_workers.checkpoint_io``, with sharded files):

* ``config.json`` + ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``: the policy, float32, HF
  names and shapes (vocabulary padding dropped, q/k/v and gate/up split back), loadable by transformers and vLLM.
* ``optimizer/``: AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` per HF tensor as ``<HF name>::<field>`` in
  safetensors shards + index, and ``param_groups.json`` (hyperparameters at save time). The moments have the
  parameters' shapes, so they go through the same conversion: the files do not depend on the TP layout, and a run may
  resume with another ``tensor_parallel_size``.

Writing gathers one Megatron tensor at a time over the TP group of the pipeline stage holding it, which broadcasts it
over the pipeline-parallel group when pp > 1 (``sync.HFGatherer``), and train rank 0 writes shards of at most 1 GiB
(``hf_io.save_hf_folder``): no rank holds the whole model or optimizer state. Every rank reads only its own slices back
(``hf_io.SafetensorsFolder``; with tied embeddings and pp > 1 the last stage's copy of the embedding and its moments
are read from ``model.embed_tokens.weight``), so a run may also resume with another ``pipeline_parallel_size``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from train_workers.checkpoint_io import restore_hyperparameters
from train_workers.megatron.hf_io import SafetensorsFolder, save_hf_folder
from train_workers.megatron.sync import hf_parameter_order, parameter_gatherer, tensor_gatherer

MOMENTS = ("exp_avg", "exp_avg_sq")


def save_checkpoint(worker, path: str) -> None:
    """Write ``worker``'s policy and AdamW state under ``path`` (a collective: every train rank calls it; rank 0
    writes). Raises RuntimeError when a parameter has no AdamW state (save after at least one step, or none at all)."""
    from transformers import AutoConfig

    writer = worker.ctx.rank == 0
    order = hf_parameter_order(worker.ctx.model_path)
    save_hf_folder(path, order, parameter_gatherer(worker), writer)
    if writer:
        AutoConfig.from_pretrained(worker.ctx.model_path).save_pretrained(path)
    params = dict(worker.policy.model.named_parameters())
    states = [worker.optimizer.state.get(p, {}) for p in params.values()]
    if any(states) and not all(states):
        raise RuntimeError("some parameters have AdamW state and others none; cannot save a partial state")
    if all(states):
        entries, sources = [], {}
        for field in MOMENTS:
            moments = {name: worker.optimizer.state[p][field] for name, p in params.items()}
            gather = tensor_gatherer(worker, moments)
            entries += [(f"{name}::{field}", shape) for name, shape in order]
            sources.update({f"{name}::{field}": (gather, name) for name, _ in order})
        step = next(iter(states))["step"]
        entries += [(f"{name}::step", ()) for name, _ in order]

        def tensor(key: str) -> torch.Tensor:
            if key.endswith("::step"):
                return torch.as_tensor(step, dtype=torch.float32).reshape(()).clone()
            gather, name = sources[key]
            return gather(name)

        save_hf_folder(os.path.join(path, "optimizer"), entries, tensor, writer)
    if writer:
        os.makedirs(os.path.join(path, "optimizer"), exist_ok=True)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in worker.optimizer.param_groups]
        with open(os.path.join(path, "optimizer", "param_groups.json"), "w") as f:
            json.dump(groups, f, indent=1)
    dist.barrier()


class _Field(Mapping):
    """HF name → the ``<HF name>::<field>`` tensor of an optimizer folder (read lazily)."""

    def __init__(self, folder: SafetensorsFolder, field: str):
        self.folder, self.field = folder, field

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.folder[f"{name}::{self.field}"]

    def __iter__(self) -> Iterator[str]:
        suffix = f"::{self.field}"
        return (k.removesuffix(suffix) for k in self.folder if k.endswith(suffix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def load_optimizer_state(worker, path: str) -> dict[str, tuple]:
    """Load ``path/optimizer`` into ``worker.optimizer``: each rank slices its shards of the HF-named moments
    (``convert.hf_to_megatron``); the hyperparameters stay the running optimizer's.

    Returns:
        ``{field: (saved value, value in use)}`` for every ``param_groups`` field that differs from the checkpoint.

    Raises:
        FileNotFoundError: ``optimizer/param_groups.json`` or the state files are missing.
        ValueError: the state names HF tensors this model does not have.
    """
    from train_workers.megatron.convert import hf_to_megatron

    folder = SafetensorsFolder(os.path.join(path, "optimizer"))
    with open(os.path.join(path, "optimizer", "param_groups.json")) as f:
        saved_groups = json.load(f)
    known = {name for name, _ in hf_parameter_order(worker.ctx.model_path)}
    unknown = {k.rpartition("::")[0] for k in folder} - known
    if unknown:
        raise ValueError(f"{path}/optimizer: state for unknown parameters {sorted(unknown)[:3]}")
    params = dict(worker.policy.model.named_parameters())
    local = {field: hf_to_megatron(_Field(folder, field), worker.layout, worker.tp_rank, worker.pp_rank)
             for field in MOMENTS}
    step = folder[f"{next(iter(known))}::step"]
    for name, p in params.items():
        worker.optimizer.state[p] = {"step": step.clone(),
                                     **{field: local[field][name].to(p.device) for field in MOMENTS}}
    configured = [{k: v for k, v in g.items() if k != "params"} for g in worker.optimizer.param_groups]
    for group, saved in zip(worker.optimizer.param_groups, saved_groups, strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    return restore_hyperparameters(worker.optimizer, configured)
