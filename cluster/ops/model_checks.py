"""Checks of the spec's train and rollout settings against the model, before any worker starts (the runtimes'
``Trainer.check`` / ``Fleet.check``, so ``grpo-cluster validate`` runs them too): ``train.lora`` targets and rank,
the train backend's model-parallel layout, and whether the engine serves LoRA adapters for the architecture.
"""

from __future__ import annotations

from cluster.data.models import ModelError

__all__ = ["check_lora", "check_train_layout"]


def check_lora(lora, model_path: str, engine: bool = True, source=None) -> None:
    """Check ``train.lora`` against the model before any worker starts: every ``target_modules`` name matches a linear
    layer of the decoder (the message lists the names the model has) and ``rank`` fits every targeted layer; with
    ``sync: adapter``, vLLM's class for the model's architecture serves LoRA adapters (``supports_lora``; checked
    when vLLM is installed here). The model is built on the meta device from its ``config.json`` (no weights are
    read). Nothing to check when ``lora`` is None (full fine-tuning).

    Args:
        engine: also check the vLLM engine's LoRA support (``sync: adapter``); the in-process runtime passes False.
        source: the spec's :class:`contract.model_source.ModelSource` (``model.revision``,
            ``model.trust_remote_code``) the config is read with; None: the defaults.

    Raises:
        ModelError: naming ``train.lora.target_modules``, ``train.lora.rank`` or ``train.lora.sync``; ``train.lora``
            when peft is not installed; ``model.path`` when its config cannot be read.
    """
    if lora is None:
        return
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ModelError("train.lora: LoRA needs the peft package, not installed in this interpreter; "
                         "pip install -e '.[lora]' (peft==0.21.0)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from contract.model_source import ModelSource
    from train_workers.lora import LoraTargetError, targeted_layers

    try:
        config = AutoConfig.from_pretrained(model_path, **(source or ModelSource()).hf_kwargs(model_path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path: cannot read the model config of {model_path}: {exc}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=(source or ModelSource()).trust_remote_code)
    try:
        targeted_layers(lora, model)
    except LoraTargetError as exc:
        raise ModelError(f"{exc.field}: {exc}") from None
    if engine and lora.sync == "adapter":
        _check_engine_serves_lora(config.architectures or [])


def check_train_layout(train, model_path: str, dtype: str) -> None:
    """Check the train backend's model-parallel layout against the model before any worker starts, through the
    backend registry: a backend class with a ``check_layout(train, model_path, dtype)`` classmethod (Megatron: TP/PP
    sizes that divide heads and layers, the settings it supports) is asked; others have nothing to check.

    Raises:
        ModelError: the backend's message, which names the spec field (``train.tensor_parallel_size``, ...) or the
            model's ``config.json`` key.
    """
    from train_workers.registry import train_backend

    check = getattr(train_backend(train.strategy), "check_layout", None)
    if check is None:
        return
    try:
        check(train, model_path, dtype)
    except (OSError, ValueError) as exc:
        raise ModelError(str(exc)) from None


def _check_engine_serves_lora(architectures: list[str]) -> None:
    """``train.lora.sync: adapter`` needs vLLM's model class for the architecture to support LoRA (vLLM's
    ``supports_lora``); unknown architectures and a missing vLLM are left to the engine's own start-up check.

    Raises:
        ModelError: naming ``train.lora.sync`` and the class without LoRA support.
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and not supports_lora(cls):
            raise ModelError(f"train.lora.sync: 'adapter' needs an engine that serves LoRA adapters, but vLLM's "
                             f"{cls.__name__} (architecture {arch}) has no LoRA support; use 'merged'")
