"""How the spec's settings map onto vLLM's options: the model's revision and remote code (``vllm.LLM``), the LoRA
rank the engine reserves, and whether vLLM's model class for an architecture serves LoRA adapters (a pre-start
check, ``contract.rollout_engine.RolloutEngine.lora_adapter_problem``)."""

from __future__ import annotations

from contract.model_source import ModelSource

__all__ = ["engine_lora_rank", "lora_adapter_problem", "source_kwargs"]


def source_kwargs(source: ModelSource, path: str) -> dict:
    """Keyword arguments for ``vllm.LLM(model=path, ...)``: ``trust_remote_code`` and, for a hub id, the same
    ``revision`` for the weights and the tokenizer (``tokenizer_revision``; :meth:`ModelSource.revision_for`)."""
    revision = source.revision_for(path)
    kwargs: dict = {"trust_remote_code": source.trust_remote_code}
    if revision is not None:
        kwargs.update(revision=revision, tokenizer_revision=revision)
    return kwargs


def engine_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` to start vLLM with for adapters of rank ``rank``: the smallest value vLLM accepts
    (``vllm.config.lora.MaxLoRARanks``) that is ≥ ``rank``.

    Raises:
        ValueError: ``rank`` exceeds vLLM's largest ``max_lora_rank``.
    """
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    for value in allowed:
        if value >= rank:
            return value
    raise ValueError(f"train.lora.rank: expected at most {allowed[-1]} (vLLM's largest max_lora_rank) for adapter "
                     f"sync, got {rank}")


def lora_adapter_problem(architectures: list[str]) -> str | None:
    """None when vLLM's model class for every one of ``architectures`` supports LoRA (vLLM's ``supports_lora``), else
    why not; unknown architectures and a missing vLLM are left to the engine's own start-up check (None)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None and not supports_lora(cls):
            return f"vLLM's {cls.__name__} (architecture {arch}) has no LoRA support"
    return None
