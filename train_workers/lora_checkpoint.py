"""Checkpoint files of a LoRA policy: a PEFT adapter folder plus the optimizer state, loading them back, and merging
an adapter folder into a full HF model folder (``grpo-cluster merge``).

Layout of a LoRA checkpoint folder (``path``), written by :func:`save_lora_checkpoint`:

* ``adapter_config.json`` + ``adapter_model.safetensors``: PEFT's adapter folder (``PeftModel.save_pretrained``),
  float32 ``lora_A``/``lora_B`` tensors under PEFT's saved names (``base_model.model.<layer>.lora_A.weight``), the
  config naming the base model (``base_model_name_or_path``: the job's ``model.path`` folder). Loadable by
  ``peft.PeftModel.from_pretrained(base, path)`` and by vLLM's LoRA loader, which read the same two files.
* ``optimizer/``: AdamW's state of the adapters (``train_workers.checkpoint_io``).

The base weights are not copied: they are the job's model folder, unchanged by training.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from train_workers.lora import ADAPTER, is_adapter
from train_workers.sharding import full_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_lora_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a PEFT adapter folder (``adapter_config.json``)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def save_lora_checkpoint(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, path: str) -> None:
    """Write the adapters of ``policy`` (a ``ResponseLogprobModel`` whose ``.model`` is the sharded PEFT model) as a
    PEFT adapter folder, and ``optimizer``'s state, to ``path``. A collective: every rank gathers each adapter
    (``full_tensor``) in the same order; rank 0 writes."""
    from train_workers.checkpoint_io import save_optimizer_state

    peft_model = policy.model
    adapters = {name: full_tensor(p.detach()).cpu().contiguous()
                for name, p in peft_model.named_parameters() if is_adapter(name)}
    if rank == 0:
        peft_model.save_pretrained(path, state_dict=adapters, safe_serialization=True)
    del adapters
    save_optimizer_state(policy, optimizer, rank, path)
    dist.barrier()


def load_adapters(peft_model: torch.nn.Module, path: str, lora) -> None:
    """Copy the adapters saved by :func:`save_lora_checkpoint` into ``peft_model`` (unsharded, before FSDP2).

    Raises:
        FileNotFoundError: ``path`` has no adapter folder (e.g. a full fine-tuning checkpoint).
        ValueError: the saved adapters were trained with another rank, alpha or target modules than ``lora`` (the
            spec's ``train.lora``), or do not cover exactly this policy's adapters.
    """
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG}; a train.lora job resumes only from a LoRA checkpoint")
    with open(config_path) as f:
        saved = json.load(f)
    want = peft_model.peft_config[ADAPTER]
    for key, ours in (("r", want.r), ("lora_alpha", want.lora_alpha),
                      ("target_modules", _targets(want.target_modules))):
        theirs = _targets(saved.get(key)) if key == "target_modules" else saved.get(key)
        if theirs != ours:
            raise ValueError(f"{config_path}: {key} {theirs!r} differs from this job's train.lora ({ours!r}); resume "
                             f"with the checkpoint's LoRA settings")
    weights = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(peft_model, weights, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if is_adapter(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}/{ADAPTER_WEIGHTS}: adapters missing {missing[:3]}, unexpected "
                         f"{list(result.unexpected_keys)[:3]}")


def _targets(value):
    """``target_modules`` as a comparable value (PEFT keeps a list as a set)."""
    return sorted(value) if isinstance(value, (list, set, tuple)) else value


def merge_lora_checkpoint(path: str, out: str, base: str | None = None) -> str:
    """Write a full HF model folder to ``out``: the base model with ``path``'s adapters merged in
    (``W + (alpha/r) · B A``, PEFT's ``merge_and_unload``), float32 safetensors, plus the tokenizer and generation
    files found in ``path`` (a checkpoint has copies of the model's). Loadable by ``transformers`` and vLLM.

    Args:
        path: a LoRA checkpoint (or any PEFT adapter folder).
        base: the base model folder; None reads ``base_model_name_or_path`` from ``adapter_config.json``.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: ``path`` is not an adapter folder, or the base model folder is missing.
        FileExistsError: ``out`` exists and is not an empty folder.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not is_lora_checkpoint(path):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG}: not a LoRA checkpoint (a full fine-tuning checkpoint "
                                f"is already an HF model folder)")
    if base is None:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            base = json.load(f).get("base_model_name_or_path")
    if not base or not os.path.isfile(os.path.join(base, "config.json")):
        raise FileNotFoundError(f"{path}: base model folder {base!r} not found (no config.json); pass --base DIR")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, path).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or name in (
                "generation_config.json", "chat_template.jinja"):
            shutil.copy2(os.path.join(path, name), os.path.join(out, name))
    return out
