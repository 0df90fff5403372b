"""The ``hf`` engine's policy copy: loading it, wrapping it with the trainer's LoRA adapters, and the tensors a weight
sync writes into it, by the names the trainer streams them under.

PEFT's conventions (not the trainer's code: ``rollout_workers`` never imports ``train_workers``): the adapter of a
``get_peft_model`` model is named ``default``; its parameters are ``...q_proj.lora_A.default.weight``, saved (and
streamed, ``train.lora.sync: adapter``) as ``...q_proj.lora_A.weight``; the wrapped model's names start with
``base_model.model.``.
"""

from __future__ import annotations

import torch

from contract.model_source import ModelSource

__all__ = ["ADAPTER", "load_model", "peft_bound_modules", "sync_targets", "with_adapters"]

#: PEFT's name of the adapter ``get_peft_model`` adds.
ADAPTER = "default"
PEFT_PREFIX = "base_model.model."
_ADAPTER_PARTS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_path: str, dtype: str, device: torch.device, source: ModelSource | None = None
               ) -> torch.nn.Module:
    """``model_path`` as an HF causal LM in ``dtype`` (``model.dtype``: float32, bfloat16 or float16) on ``device``,
    in eval mode without gradients.

    Raises:
        ValueError: an unknown ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype],
                                                 **(source or ModelSource()).hf_kwargs(model_path))
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def with_adapters(model: torch.nn.Module, adapter_config: dict) -> torch.nn.Module:
    """``model`` wrapped by PEFT with ``adapter_config`` (the trainer's ``adapter_config.json``): adapters at their
    ``B = 0`` start, so the base model's outputs; eval mode, no gradients."""
    from peft import get_peft_config, get_peft_model

    wrapped = get_peft_model(model, get_peft_config(dict(adapter_config)))
    wrapped.eval()
    wrapped.requires_grad_(False)
    return wrapped


def _is_adapter(name: str) -> bool:
    return any(part in name for part in _ADAPTER_PARTS)


def _saved_name(name: str) -> str:
    for part in _ADAPTER_PARTS:
        name = name.replace(part, part.removesuffix(f"{ADAPTER}."))
    return name


def sync_targets(model: torch.nn.Module, adapter: bool) -> dict[str, torch.nn.Parameter]:
    """The model's tensors a sync writes, by the names the trainer streams them under.

    Args:
        adapter: ``train.lora.sync: adapter``: only the adapter tensors, under PEFT's saved names
            (``...q_proj.lora_A.weight``); else every parameter under its HF name (tied weights once:
            ``named_parameters`` lists a shared tensor once, so a tied LM head follows its embedding).
    """
    if adapter:
        return {_saved_name(n): p for n, p in model.named_parameters() if _is_adapter(n)}
    return dict(model.named_parameters())


def peft_bound_modules(model: torch.nn.Module) -> list[str]:
    """The modules (HF names, sorted) whose LoRA adapter is in effect in a PEFT model: every PEFT ``LoraLayer`` that
    holds the ``default`` adapter as an active adapter, with adapters enabled, not merged into its base weight (a
    sync writes the adapter tensors, which a merged layer no longer reads) and a non-zero scaling. [] for a model
    without PEFT layers."""
    from peft.tuners.lora import LoraLayer

    bound = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        if module.disable_adapters or module.merged or ADAPTER not in module.active_adapters:
            continue
        if module.scaling.get(ADAPTER, 0.0) == 0.0:
            continue
        bound.append(name.removeprefix(PEFT_PREFIX))
    return sorted(bound)
