"""Checkpoint files of an FSDP2 policy and its AdamW optimizer: tensors and JSON only (loading unpickles nothing).

Layout of a checkpoint folder (``path``):

* ``config.json`` + ``model.safetensors``: the policy as an HF folder, written by rank 0. The weights are the
  parameters as trained — float32, also with ``model.dtype`` bfloat16/float16, whose mixed precision keeps float32
  master weights — so a resume continues from exactly these values; vLLM (``--dtype bfloat16``) and
  ``from_pretrained(..., dtype=torch.bfloat16)`` cast on load. Tied weights are written once, as transformers does.
* ``optimizer/state.safetensors``: per parameter ``<name>::<exp_avg|exp_avg_sq|step>``; ``optimizer/param_groups.json``:
  the hyperparameters at save time (a subfolder, because vLLM loads every top-level ``*.safetensors`` as weights).

On load the moments and step come from the files; the hyperparameters stay the running optimizer's (its spec's).
A LoRA policy's checkpoint holds a PEFT adapter folder instead of the HF folder (``train_workers.lora_checkpoint``) and
the same ``optimizer/`` files, for the adapters only.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def save_checkpoint(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, path: str) -> None:
    """Write ``policy`` (a ``ResponseLogprobModel``: its ``.model`` is the HF model) and ``optimizer``'s state to
    ``path``; every rank of the train group calls it (gathering full tensors to CPU is a collective), rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(policy, options=options)
    if rank == 0:
        hf = policy.model
        aliases = ({n for n, _ in hf.named_parameters(remove_duplicate=False)}
                   - {n for n, _ in hf.named_parameters()})
        state = {k.removeprefix("model."): v for k, v in full.items()}
        state = {k: v for k, v in state.items() if k not in aliases}
        hf.save_pretrained(path, state_dict=state, safe_serialization=True)
    del full
    save_optimizer_state(policy, optimizer, rank, path)
    dist.barrier()


def save_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, path: str) -> None:
    """Write ``optimizer``'s state (full tensors, rank 0 writes) to ``path/optimizer/``: a collective, every rank of
    the train group calls it. Parameters without state (frozen ones, e.g. a LoRA policy's base) are not in it."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim = get_optimizer_state_dict(policy, optimizer, options=options)
    if rank == 0:
        tensors = {f"{name}::{key}": torch.as_tensor(value).contiguous()
                   for name, per_param in optim["state"].items() for key, value in per_param.items()}
        os.makedirs(os.path.join(path, "optimizer"), exist_ok=True)
        save_file(tensors, os.path.join(path, "optimizer", "state.safetensors"))
        with open(os.path.join(path, "optimizer", "param_groups.json"), "w") as f:
            json.dump(optim["param_groups"], f, indent=1)
    del optim


def load_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> dict[str, tuple]:
    """Restore the AdamW moments and step count saved by :func:`save_checkpoint` into ``optimizer`` (each rank keeps
    its own shards), keeping ``optimizer``'s hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay`` and every
    other ``param_groups`` field): a run resumed with ``--set train.lr=...`` trains at the lr it reports.

    Returns:
        ``{field: (saved value, value in use)}`` for every ``param_groups`` field that differs from the checkpoint.

    Raises:
        FileNotFoundError: ``optimizer/state.safetensors`` or ``optimizer/param_groups.json`` is missing.
        ValueError: the saved state names parameters this policy does not have.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    tensors = load_file(os.path.join(path, "optimizer", "state.safetensors"))
    with open(os.path.join(path, "optimizer", "param_groups.json")) as f:
        param_groups = json.load(f)
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("::")
        state.setdefault(name, {})[field] = value
    known = {n for g in param_groups for n in g["params"]}
    if set(state) - known:
        raise ValueError(f"{path}/optimizer/state.safetensors: state for unknown parameters "
                         f"{sorted(set(state) - known)[:3]}")
    for group in param_groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    set_optimizer_state_dict(policy, optimizer, {"state": state, "param_groups": param_groups},
                             options=StateDictOptions(full_state_dict=True))
    return restore_hyperparameters(optimizer, configured)


def restore_hyperparameters(optimizer: torch.optim.Optimizer, configured: list[dict]) -> dict[str, tuple]:
    """Put back the ``param_groups`` fields (all but ``params``) the optimizer was built with, after a state dict
    load overwrote them; returns ``{field: (loaded value, restored value)}`` for those that differed."""
    changed: dict[str, tuple] = {}
    for group, want in zip(optimizer.param_groups, configured, strict=True):
        for key, value in want.items():
            loaded = group.get(key)
            loaded = tuple(loaded) if isinstance(loaded, list) else loaded  # JSON has lists where AdamW has tuples
            if _differs(loaded, value):
                changed.setdefault(key, (loaded, value))
            group[key] = value
    return changed


def _differs(a, b) -> bool:
    """Hyperparameter values compared as JSON stores them (a tuple equals its list; tensors by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b
