"""The ``algorithm`` section of a job spec: the GRPO objective and the sampling rules around it.

Every option maps to a pure function in ``grpo/`` (formulas and sources in docs/algorithm.md and in
those functions' docstrings). Checks that involve other sections (``rollout.max_response_tokens``,
``rollout.group_size``) are in :func:`algorithm_conflicts`, which ``JobSpec`` runs. The fields that select a
registered variant (``advantage_estimator``, ``loss_agg``, ``kl_estimator``, ``tis_level``, ``mis.level``) are
checked against their ``grpo`` registry at validation (:mod:`cluster.spec.variants`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from cluster.spec.variants import ADVANTAGE_ESTIMATOR, KL_ESTIMATOR, LOSS_AGGREGATION, MIS_LEVEL, TIS_LEVEL

__all__ = ["REWARD_NAMES", "AlgorithmSpec", "FieldConflict", "MisSpec", "algorithm_conflicts", "check_reward_key",
           "reward_names"]

MAX_GROUP_SIZE = 1024
"""Largest G (completions per prompt) any setting may ask for; ``rollout.group_size`` has the same bound."""

REWARD_NAMES: tuple[str, ...] = ("accuracy", "format", "math")
"""Builtin reward functions a spec may weight in ``algorithm.rewards`` (more may be registered, see reward_names)."""


def reward_names() -> tuple[str, ...]:
    """Names registered in ``grpo.rewards.REWARD_FUNCTIONS`` (builtins: accuracy, format, math, reasoning_gym), read
    at validation time so functions registered by user code before the spec is loaded are accepted; keys a spec named
    by location (``file.py:function``), registered when it was loaded, are not listed."""
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.rewards.loading import is_location

    return tuple(sorted(name for name in REWARD_FUNCTIONS if not is_location(name)))  # not keys a spec loaded


def check_reward_key(key: str, info: ValidationInfo | None = None) -> str:
    """A reward key of the spec: a registered name, or ``module:function`` / ``path/to/file.py:function``, which
    is imported now (relative to the spec file's folder, the validation context's ``base_dir``, else the working
    folder) and registered under the key (``grpo.rewards.loading.register_spec_reward``).

    Raises:
        ValueError: an unknown name (listing the registered ones and how to add one), or a function that cannot be
            loaded (the message names the file and line).
    """
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.rewards.calling import RewardError
    from grpo.rewards.loading import HOW_TO_NAME_A_REWARD, is_location, register_spec_reward

    if not is_location(key):
        if key in REWARD_FUNCTIONS:
            return key
        raise ValueError(f"unknown reward {key!r}; allowed: {', '.join(reward_names())}; {HOW_TO_NAME_A_REWARD}")
    base_dir = (info.context or {}).get("base_dir") if info is not None else None
    try:
        register_spec_reward(key, base_dir)
    except RewardError as exc:
        raise ValueError(str(exc)) from None
    return key


class FieldConflict(ValueError):
    """A cross-field check failed; ``field`` is the dotted path (from the job root) the message should point at."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class MisSpec(BaseModel):
    """Masked importance sampling (``algorithm.mis``): drop tokens or whole sequences whose importance ratio
    pi_proximal / pi_behaviour (trainer before the step / engine) lies outside [low, high] from the loss
    (``grpo.off_policy.mis_keep_mask``; sources there). Dropped tokens leave both the sum and the token/sequence
    counts of the loss aggregation. Costs one no-grad policy forward per micro-batch when num_iterations is 1 (the
    proximal logprobs must be known before the loss, to count the kept tokens over all ranks)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    level: Annotated[str, MIS_LEVEL.validator] = Field(strict=True, description=MIS_LEVEL.describe(
        "Which tokens the band drops", "token (drop single tokens whose ratio is outside the band), sequence (drop "
        "every token of a sequence whose geometric-mean ratio exp(mean of log ratios) is outside the band)"))
    low: float = Field(strict=True, gt=0, description="Lower end of the kept ratio band (inclusive), in (0, 1).")
    high: float = Field(strict=True, gt=0, description="Upper end of the kept ratio band (inclusive), > 1.")

    @model_validator(mode="after")
    def _band(self) -> MisSpec:
        if not self.low < self.high:
            raise FieldConflict("algorithm.mis.high", (
                f"expected the MIS band low < high, got low={self.low!r}, high={self.high!r}"))
        # ratio 1 is an on-policy token: a band without it drops (nearly) every token of a sync step, and a bound
        # beyond exp(+-20) would meet the clamped log ratios instead of the true ones
        for name, value, ok in (("low", self.low, self.low < 1.0), ("high", self.high, self.high > 1.0)):
            if not ok:
                raise FieldConflict(f"algorithm.mis.{name}", (
                    f"expected the MIS band to hold ratio 1 (low < 1 < high: on-policy tokens are kept), got "
                    f"{name}={value!r}"))
        return self


class AlgorithmSpec(BaseModel):
    """GRPO objective: advantage estimator, clipped policy loss, KL to the reference policy, rewards, sampling."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # ---- advantages
    advantage_estimator: Annotated[str, ADVANTAGE_ESTIMATOR.validator] = Field(
        "grpo", strict=True, description=ADVANTAGE_ESTIMATOR.describe(
            "Group advantage", "grpo (mean/std), dr_grpo (mean only), rloo (leave-one-out mean)"))
    adv_eps: float = Field(1e-6, strict=True, gt=0, description="Added to the group std before dividing (grpo).")
    adv_std: Literal["unbiased", "biased"] = Field("unbiased", description="Group std with N-1 or N denominator.")
    # ---- policy loss
    loss_agg: Annotated[str, LOSS_AGGREGATION.validator] = Field(
        "seq-mean-token-mean", strict=True, description=LOSS_AGGREGATION.describe(
            "How per-token losses are reduced to one scalar", "token-mean, seq-mean-token-mean, "
            "seq-mean-token-sum-norm"))
    clip_eps_low: float = Field(0.2, strict=True, ge=0, lt=1, description=(
        "Lower ratio clip: ratio >= 1 - clip_eps_low."))
    clip_eps_high: float = Field(0.2, strict=True, ge=0, description="Upper ratio clip: ratio <= 1 + clip_eps_high.")
    dual_clip_c: float | None = Field(None, strict=True, gt=1, description=(
        "Dual clip (Ye et al. 2020): for negative advantages the token loss is at most c·|A|; null disables."))
    entropy_coef: float = Field(0.0, strict=True, ge=0, description="Weight of the entropy bonus.")
    num_iterations: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Optimizer steps per rollout batch; the behaviour logprobs of all of them are the trainer's, before the "
        "first step."))
    tis_cap: float | None = Field(None, strict=True, gt=0, description=(
        "Truncated importance sampling: weight each token by min(pi_old_trainer / pi_engine, tis_cap); "
        "null disables."))
    tis_level: Annotated[str, TIS_LEVEL.validator] = Field("token", strict=True, description=TIS_LEVEL.describe(
        "With tis_cap, how the truncated ratios weight the tokens (grpo.off_policy.importance_weights)",
        "token (each token by its own truncated ratio), sequence (every token of a sequence by min(product of its "
        "token ratios, tis_cap))"))
    mis: MisSpec | None = Field(None, description=(
        "Masked importance sampling: {level: a name in grpo.off_policy.MIS_LEVELS (built in: token, sequence), "
        "low, high}; tokens or sequences whose ratio pi_old_trainer / pi_engine is outside [low, high] leave the "
        "loss. null disables."))
    # ---- KL to the reference policy
    kl_coef: float = Field(0.04, strict=True, ge=0, description=(
        "beta: weight of the KL penalty to the reference policy (initial value when kl_controller is adaptive)."))
    kl_estimator: Annotated[str, KL_ESTIMATOR.validator] = Field("k3", strict=True, description=KL_ESTIMATOR.describe(
        "KL estimator", "k1, k2, k3 (Schulman's)"))
    kl_in_reward: bool = Field(False, description=(
        "Put the KL in the reward as a per-token penalty (return-to-go added to the advantage) instead of the loss."))
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description=(
        "fixed: beta = kl_coef; adaptive: beta steered so the measured KL approaches kl_target (Ziegler et al. 2019)."))
    kl_target: float = Field(0.01, strict=True, gt=0, description="Adaptive controller: target KL in nats per token.")
    kl_horizon_sequences: int = Field(10_000, ge=1, strict=True, description=(
        "Adaptive controller horizon in sequences: beta moves by at most 20% x sequences per step / horizon."))
    # ---- rewards
    rewards: dict[str, StrictFloat] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.1}, description=(
        f"Reward function -> weight. A key is a registered name (builtins: {', '.join(REWARD_NAMES)}, "
        "reasoning_gym), 'module:function', or 'path/to/file.py:function' (relative to the spec file); the "
        "function is called fn(prompts=..., completions=..., **columns) or fn(completions, references) and returns "
        "one float or None (no score) per completion (docs/own_task.md)."))
    reward_combine: Literal["sum-then-normalise", "normalise-then-sum"] = Field(
        "sum-then-normalise", description=(
            "sum-then-normalise: advantage of the weighted reward sum; normalise-then-sum: weighted sum of each "
            "reward's own group advantage."))
    reward_on_error: Literal["raise", "none"] = Field("raise", description=(
        "A reward function that raises: 'raise' fails the step naming it; 'none' gives its completions no reward "
        "(counted in reward/failed), an infrastructure failure like a None score."))
    max_infra_failed_fraction: float = Field(0.5, strict=True, ge=0, le=1, description=(
        "Completions without a reward (a function returned None, or raised with reward_on_error 'none': an "
        "infrastructure failure, not the policy's) are left out of their group's statistics, of the loss and of "
        "the step's metrics, and counted in reward/infra_failed. A sampling round (the step's batch, without "
        "dynamic sampling) where more than this fraction of completions have none stops the job naming this field; "
        "one where every completion has none always stops it. 0 stops at the first."))
    # ---- truncated completions
    mask_truncated: bool = Field(False, description=(
        "Completions without EOS (cut at max_response_tokens) are masked out of the loss (DAPO overlong filtering)."))
    overlong_buffer_tokens: int | None = Field(None, ge=1, strict=True, description=(
        "DAPO soft overlong punishment: penalty ramps from 0 to -overlong_penalty_factor over the last this-many "
        "tokens before max_response_tokens; null disables."))
    overlong_penalty_factor: float = Field(1.0, strict=True, ge=0, description=(
        "Scale of the overlong penalty (reward units)."))
    # ---- sampling
    dynamic_sampling: bool = Field(False, description=(
        "DAPO dynamic sampling: drop groups whose advantages are all zero and sample more prompts until "
        "rollout.prompts_per_step informative groups or max_sampling_rounds."))
    max_sampling_rounds: int = Field(3, ge=1, le=1024, strict=True, description=(
        "Bound on generation rounds per step (dynamic sampling)."))
    group_size_schedule: tuple[tuple[StrictInt, StrictInt], ...] = Field((), description=(
        "[[step, G], ...]: from each step on, sample G completions per prompt (before the first entry: "
        "rollout.group_size)."))
    group_size_max: int | None = Field(None, ge=2, le=MAX_GROUP_SIZE, strict=True, description=(
        "Adaptive group size: double G (up to this) after a step whose all-equal group fraction exceeds "
        "group_size_rise_threshold; null disables."))
    group_size_rise_threshold: float = Field(0.5, strict=True, gt=0, le=1, description=(
        "All-equal group fraction above which the adaptive group size rises."))

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, rewards: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        from grpo.rewards import RESERVED_REWARD_NAMES

        reserved = sorted(set(rewards) & RESERVED_REWARD_NAMES)
        if reserved:
            raise ValueError(f"reward name {reserved[0]!r} is reserved: reward/{reserved[0]} is a metric the driver "
                             f"reports (reserved: {', '.join(sorted(RESERVED_REWARD_NAMES))}); rename the function")
        allowed = reward_names()
        from grpo.rewards.loading import HOW_TO_NAME_A_REWARD, is_location

        unknown = sorted(k for k in set(rewards) - set(allowed) if not is_location(k))
        if unknown:
            raise ValueError(f"unknown reward {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}; "
                             f"{HOW_TO_NAME_A_REWARD}")
        for key in rewards:
            check_reward_key(key, info)
        if not rewards:
            raise ValueError(f"expected at least one reward from {', '.join(REWARD_NAMES)}, got none")
        return rewards

    @field_validator("group_size_schedule")
    @classmethod
    def _schedule(cls, schedule: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        steps = [step for step, _ in schedule]
        if any(step < 1 for step in steps) or steps != sorted(set(steps)):
            raise ValueError(f"expected [step, G] pairs with steps >= 1 strictly increasing, got steps {steps}")
        if any(not 2 <= g <= MAX_GROUP_SIZE for _, g in schedule):
            raise ValueError(f"expected every G >= 2 (a group needs two completions) and <= {MAX_GROUP_SIZE}, "
                             f"got {[g for _, g in schedule]}")
        return schedule

    @model_validator(mode="after")
    def _tis_level_needs_a_cap(self) -> AlgorithmSpec:
        if self.tis_level != "token" and self.tis_cap is None:
            raise FieldConflict("algorithm.tis_level", (
                f"tis_level={self.tis_level!r} needs algorithm.tis_cap (the truncation cap), got null"))
        return self

    @model_validator(mode="after")
    def _needs_a_kl_coef(self) -> AlgorithmSpec:
        for name, on in (("kl_controller", self.kl_controller == "adaptive"), ("kl_in_reward", self.kl_in_reward)):
            if on and self.kl_coef == 0:
                raise FieldConflict(f"algorithm.{name}", (
                    f"{name}={getattr(self, name)!r} needs algorithm.kl_coef > 0 (the initial beta), got 0"))
        return self


def algorithm_conflicts(alg: AlgorithmSpec, rollout) -> list[FieldConflict]:
    """Checks between ``algorithm`` and ``rollout`` (a ``RolloutSpec``); empty when consistent."""
    out = []
    cap = rollout.max_response_tokens
    if alg.overlong_buffer_tokens is not None and alg.overlong_buffer_tokens > cap:
        out.append(FieldConflict("algorithm.overlong_buffer_tokens", (
            f"expected overlong_buffer_tokens <= rollout.max_response_tokens = {cap}, "
            f"got {alg.overlong_buffer_tokens}")))
    if alg.group_size_max is not None:
        largest = max([rollout.group_size, *(g for _, g in alg.group_size_schedule)])
        if alg.group_size_max < largest:
            out.append(FieldConflict("algorithm.group_size_max", (
                f"expected group_size_max >= the largest configured G (rollout.group_size and "
                f"group_size_schedule) = {largest}, got {alg.group_size_max}")))
    return out
