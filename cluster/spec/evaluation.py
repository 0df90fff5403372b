"""The ``eval`` section of a job spec: held-out evaluation inside the training loop.

Absent (``eval: null``, the default) means no evaluation: the loop and its metrics are exactly as without this
section. Present, the driver scores held-out prompts on the rollout engines between steps (``cluster.loop.
evaluation``) and logs ``eval/*`` metrics. The fields follow what verl (``trainer.test_freq``, ``val_before_train``,
``data.val_files``, ``val_kwargs.{n, temperature}``) and TRL (``eval_steps``, ``eval_on_start``) users set.

Checks that involve other sections (the engine's context length, ``data.test_path``) are in :func:`eval_conflicts`,
which ``JobSpec`` runs. Imports only pydantic and :mod:`cluster.spec` modules (and, lazily, ``grpo.rewards`` for
registered reward names).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from cluster.spec.algorithm import FieldConflict, check_reward_key
from cluster.spec.fields import MAX_SEQUENCE_TOKENS, MIN_TEMPERATURE, SPEC_CONFIG

__all__ = ["MAX_EVAL_SAMPLES", "EvalSpec", "eval_conflicts"]

#: Largest ``eval.samples`` (completions per held-out prompt); a typo guard like the other bounds.
MAX_EVAL_SAMPLES = 1024


class EvalSpec(BaseModel):
    """Held-out evaluation between steps: pass@1 (mean@k with samples > 1) with a 95 % Wilson interval."""

    model_config = SPEC_CONFIG
    every_steps: int | None = Field(None, ge=1, le=10_000_000, strict=True, description=(
        "Evaluate after every this many steps (after the step's weight sync, on the new weights); null evaluates "
        "only at start and end (at_start, at_end)."))
    at_start: bool = Field(True, strict=True, description=(
        "Evaluate the starting weights before step 1 (logged as a row of its own with step 0; a resumed job does "
        "not repeat it)."))
    at_end: bool = Field(True, strict=True, description=(
        "Evaluate after the last step (total_steps)."))
    data_path: str | None = Field(None, min_length=1, description=(
        "Held-out jsonl file (the same row format and fields as data.train_path); null uses data.test_path. A "
        "relative path is resolved like data.train_path."))
    limit: int | None = Field(None, ge=1, le=100_000_000, strict=True, description=(
        "Evaluate the first this many usable rows of the file, in file order; null evaluates all of them."))
    max_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Completion length cap in tokens; null uses rollout.max_response_tokens. A completion cut here counts as "
        "truncated (eval/truncated_fraction)."))
    samples: int = Field(1, ge=1, le=MAX_EVAL_SAMPLES, strict=True, description=(
        "Completions per prompt (k). 1 gives pass@1; k > 1 gives mean@k (the mean over prompts of the fraction "
        "of its k completions that are correct) and needs temperature > 0."))
    temperature: float = Field(0.0, strict=True, ge=0, le=10, description=(
        "Sampling temperature; 0 is greedy decoding. A value in (0, 0.01) is refused (vLLM would raise it to "
        "0.01). Sampling uses top_p 1, top_k off and a fixed seed per prompt and sample, the same at every eval."))
    accuracy_reward: str = Field("accuracy", min_length=1, description=(
        "Reward function (a registered name, 'module:function' or 'path/to/file.py:function', as in "
        "algorithm.rewards) whose score, in [0, 1] with 1 = correct, is eval/accuracy."))
    format_reward: str | None = Field("format", min_length=1, description=(
        "Reward function (as accuracy_reward) reported as eval/format_rate (the fraction of completions it pays, "
        "mean score); null reports none."))

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or a temperature >= {MIN_TEMPERATURE} (vLLM raises a lower one "
                             f"to {MIN_TEMPERATURE}), got {temperature!r}")
        return temperature

    @field_validator("accuracy_reward", "format_reward")
    @classmethod
    def _known_reward(cls, name: str | None, info: ValidationInfo) -> str | None:
        return None if name is None else check_reward_key(name, info)

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> EvalSpec:
        if self.samples > 1 and self.temperature == 0:
            raise FieldConflict("eval.samples", (
                f"samples={self.samples} needs eval.temperature > 0: greedy completions of one prompt are "
                f"identical, so mean@k would equal pass@1"))
        if not (self.at_start or self.at_end or self.every_steps):
            raise FieldConflict("eval.every_steps", (
                "eval never runs: every_steps is null and at_start and at_end are false; set one, or drop the "
                "eval section"))
        return self


def eval_conflicts(ev: EvalSpec, data, rollout) -> list[FieldConflict]:
    """Checks between ``eval`` and ``data``/``rollout`` (a ``DataSpec`` and a ``RolloutSpec``); empty when
    consistent: a held-out file is named (``eval.data_path`` or ``data.test_path``), and the longest prompt the job
    accepts plus ``eval.max_tokens`` fits the engine's context (``rollout.max_model_len`` when set)."""
    out = []
    by_agent = getattr(rollout, "agent", None) is not None  # the agent scores its own episodes
    generated = data.source == "reasoning_gym"
    own_split = data.source in ("humaneval", "code_functions") or (data.source == "hf_hub"
                                                                    and data.hub.test_split is not None)
    if ev.data_path is None and data.test_path is None and not generated and not own_split:
        split = " or data.hub.test_split" if data.source == "hf_hub" else " (or data.test_path)"
        out.append(FieldConflict("eval.data_path", (
            f"expected a held-out file: set eval.data_path{split}, got neither")))
    if generated and ev.data_path is None and ev.accuracy_reward != "reasoning_gym" and not by_agent:
        out.append(FieldConflict("eval.accuracy_reward", (
            "the held-out split of data.source 'reasoning_gym' is scored by the task's own scorer: expected "
            f"'reasoning_gym', got {ev.accuracy_reward!r}")))
    code = data.source in ("humaneval", "code_functions") and not by_agent
    named = {"humaneval": "HumanEval", "code_functions": "code_functions"}.get(data.source)
    if code and ev.accuracy_reward == "accuracy":
        out.append(FieldConflict("eval.accuracy_reward", (
            f"{named} problems are scored by running their tests: expected 'code' ('code_asserts', or a reward of "
            f"your own), got 'accuracy' (the GSM8K answer checker, the default)")))
    if code and ev.format_reward == "format":
        out.append(FieldConflict("eval.format_reward", (
            "'format' (the default) is GSM8K's worked-solution rule and never pays for code: expected null or a "
            "reward of your own, got 'format'")))
    for name in () if by_agent else ("accuracy_reward", "format_reward"):
        if getattr(ev, name) == "reasoning_gym" and (not generated or ev.data_path is not None):
            out.append(FieldConflict(f"eval.{name}", (
                "'reasoning_gym' scores problems of the reasoning-gym held-out split only: expected data.source "
                f"'reasoning_gym' and no eval.data_path, got data.source {data.source!r}, eval.data_path "
                f"{ev.data_path!r}")))
    if ev.max_tokens is not None:
        context = rollout.max_model_len or data.max_prompt_tokens + rollout.max_response_tokens
        named = ("rollout.max_model_len" if rollout.max_model_len
                 else "data.max_prompt_tokens + rollout.max_response_tokens")
        if data.max_prompt_tokens + ev.max_tokens > context:
            out.append(FieldConflict("eval.max_tokens", (
                f"expected data.max_prompt_tokens + eval.max_tokens <= the engine context ({named} = {context}), "
                f"got {data.max_prompt_tokens} + {ev.max_tokens}; lower eval.max_tokens or set "
                f"rollout.max_model_len")))
    return out
