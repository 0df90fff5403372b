"""Checks of the spec's train and rollout settings against the model, before any worker starts (the runtimes'
``Trainer.check`` / ``Fleet.check``, so ``grpo-cluster validate`` runs them too): ``train.lora`` targets and rank,
the train backend's model-parallel layout, whether the engine serves LoRA adapters for the architecture, and whether
the engines' context fits the model's positions.
"""

from __future__ import annotations

from cluster.data.models import ModelError

__all__ = ["check_engine_context", "check_lora", "check_train_layout", "model_context"]

#: ``config.json`` keys that bound a model's positions (the keys vLLM derives its own limit from); the smallest wins.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_target_positions")


def check_lora(lora, model_path: str, engine: str | None = "vllm", source=None) -> None:
    """Check ``train.lora`` against the model before any worker starts: every ``target_modules`` name matches a linear
    layer of the decoder (the message lists the names the model has) and ``rank`` fits every targeted layer; with
    ``sync: adapter``, the rollout engine serves LoRA adapters for the model's architecture (the engine's own
    ``lora_adapter_problem``: vLLM's ``supports_lora``, checked when vLLM is installed here). The model is built on
    the meta device from its ``config.json`` (no weights are read). Nothing to check when ``lora`` is None (full
    fine-tuning).

    Args:
        engine: the ``rollout.engine`` whose LoRA support is checked (``sync: adapter``); None checks no engine.
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
    if engine is not None and lora.sync == "adapter":
        _check_engine_serves_lora(engine, config.architectures or [])


def model_context(config) -> tuple[str, int] | None:
    """(key, positions) of the smallest :data:`CONTEXT_KEYS` entry of a model's config (an ``AutoConfig``, or its
    ``text_config`` for a multimodal one); None when it has none, or when its RoPE is scaled (``rope_scaling`` /
    ``rope_parameters`` of a type other than ``default``: the engine stretches the positions by rules of its own, so
    only the engine can say how far)."""
    config = getattr(config, "text_config", None) or config
    if _rope_scaled(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)):
        return None
    found = [(key, value) for key in CONTEXT_KEYS if isinstance(value := getattr(config, key, None), int) and value > 0]
    return min(found, key=lambda item: item[1]) if found else None


def _rope_scaled(rope) -> bool:
    """Whether a config's ``rope_parameters`` (transformers 5; per layer type for some models) or ``rope_scaling``
    stretches the positions: a type other than ``default``, or a ``factor``."""
    if not isinstance(rope, dict):
        return False
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return any(map(_rope_scaled, rope.values()))
    return rope.get("rope_type", rope.get("type", "default")) != "default" or "factor" in rope


def check_engine_context(spec, model_path: str, source=None) -> None:
    """Check before any engine starts that its context (``rollout.max_model_len``, else what the spec implies:
    ``cluster.spec.agents.context_tokens``) fits the model's positions (:func:`model_context`): vLLM refuses a
    longer one when the engine is built (a traceback from inside a Ray actor), and positions past the trained range
    are nonsense to any engine.

    Raises:
        ModelError: naming the spec field(s) the context comes from, its value, the model's ``config.json`` key and
            its value; ``model.path`` when its config cannot be read.
    """
    from transformers import AutoConfig

    from cluster.spec.agents import context_tokens
    from contract.model_source import ModelSource

    try:
        config = AutoConfig.from_pretrained(model_path, **(source or ModelSource()).hf_kwargs(model_path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path: cannot read the model config of {model_path}: {exc}") from None
    limit = model_context(config)
    r = spec.rollout
    context = r.max_model_len or context_tokens(r, spec.data.max_prompt_tokens)
    if limit is None or context <= limit[1]:
        return
    if r.max_model_len is not None:
        named = "rollout.max_model_len"
    elif r.agent is not None:
        named = "rollout.agent_pool.max_episode_tokens (the longest context of an agent's call)"
    elif r.multi_turn is not None:
        named = "data.max_prompt_tokens + rollout.multi_turn.max_episode_tokens"
    else:
        named = "data.max_prompt_tokens + rollout.max_response_tokens"
    raise ModelError(f"{named}: expected an engine context of at most the model's {limit[0]} = {limit[1]} tokens "
                     f"({model_path}/config.json), got {context}")


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


def _check_engine_serves_lora(engine: str, architectures: list[str]) -> None:
    """``train.lora.sync: adapter`` needs the rollout engine ``engine`` to serve LoRA adapters for the architecture
    (``RolloutEngine.lora_adapter_problem``, ``rollout_workers.registry``).

    Raises:
        ModelError: naming ``train.lora.sync`` and why the engine cannot serve adapters.
    """
    from rollout_workers.registry import rollout_engine

    problem = rollout_engine(engine).lora_adapter_problem(architectures)
    if problem is not None:
        raise ModelError(f"train.lora.sync: 'adapter' needs an engine that serves LoRA adapters, but {problem}; "
                         f"use 'merged'")
