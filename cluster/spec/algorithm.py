"""The ``algorithm`` section of a job spec: the GRPO objective and the sampling rules around it.

Every option maps to a pure function in ``grpo/`` (formulas and sources in docs/algorithm.md and in
those functions' docstrings). Checks that involve other sections (``rollout.max_response_tokens``,
``rollout.group_size``) are in :func:`algorithm_conflicts`, which ``JobSpec`` runs. The fields that select a
registered variant (``advantage_estimator``, ``policy_loss``, ``loss_agg``, ``kl_estimator``, ``tis_level``,
``mis.level``) are checked against their ``grpo`` registry at validation (:mod:`cluster.spec.variants`).

Settings a choice implies unless the spec sets them (:mod:`cluster.spec.implied`, ``grpo.registry.set_implied``):
gspo and gspo_token GSPO's clip range 3e-4 / 4e-4, cispo ``clip_eps_low`` 0.999, dr_grpo ``loss_agg:
seq-mean-token-sum-norm``; ``grpo-cluster validate`` prints the values in force and which were implied.

Off-policy default (``off_policy_correction``): ``rollout.mode`` one_step_off and async train on samples of an older
policy, so unless the spec chooses a correction (``tis_cap`` or ``mis``) the train ranks run token-level truncated
importance sampling against the engine's logprobs with cap :data:`DEFAULT_TIS_CAP` (:func:`effective_algorithm`; the
spec itself is never rewritten). ``off_policy_correction: none`` turns that off; such a job is warned about
(:func:`off_policy_warning`) by ``grpo-cluster validate`` and at job start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from cluster.spec.fields import MAX_COEFFICIENT, MAX_COUNT, MAX_RATIO, FieldConflict, unused_when_off
from cluster.spec.implied import Rule, with_implied
from cluster.spec.variants import (ADVANTAGE_ESTIMATOR, KL_ESTIMATOR, LOSS_AGGREGATION, MIS_LEVEL, POLICY_LOSS,
                                   TIS_LEVEL, implied_by_choices)

__all__ = ["DEFAULT_TIS_CAP", "OFF_POLICY_MODES", "REWARD_NAMES", "AlgorithmSpec", "FieldConflict", "MisSpec",
           "algorithm_conflicts", "algorithm_implied", "check_reward_key", "describe_off_policy", "effective_algorithm",
           "off_policy_warning", "reward_names"]

MAX_GROUP_SIZE = 1024
"""Largest G (completions per prompt) any setting may ask for; ``rollout.group_size`` has the same bound."""

DEFAULT_TIS_CAP = 2.0
"""The cap C of the default behaviour correction in one_step_off/async (token-level TIS, w_t = min(π_prox/π_b, C)):
the value of truncated importance sampling's authors (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training") and of the peers that ship it (verl's and slime's TIS examples, SkyRL's
``token_tis_ratio_clip_high``); measured here in ``docs/results.md`` ("Off-policy correction")."""

OFF_POLICY_MODES = ("one_step_off", "async")
"""``rollout.mode`` values whose samples come from an older policy than the one that trains on them."""

REWARD_NAMES: tuple[str, ...] = ("accuracy", "format", "math", "reasoning_gym", "code", "code_asserts")
"""Builtin reward functions a spec may weight in ``algorithm.rewards`` (more may be registered, see reward_names)."""


def reward_names() -> tuple[str, ...]:
    """Names registered in ``grpo.rewards.REWARD_FUNCTIONS`` (builtins: :data:`REWARD_NAMES`), read
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
    low: float = Field(strict=True, ge=1 / MAX_RATIO, description=(
        "Lower end of the kept ratio band (inclusive), in [e^-20, 1) (the ratio is clamped at e^-20)."))
    high: float = Field(strict=True, gt=0, le=MAX_RATIO, description=(
        "Upper end of the kept ratio band (inclusive), in (1, e^20] (the ratio is clamped at e^20)."))

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


#: The ``algorithm`` fields that select a registered variant whose entry may imply companion settings.
IMPLYING_SELECTORS = (ADVANTAGE_ESTIMATOR, POLICY_LOSS, LOSS_AGGREGATION, KL_ESTIMATOR, TIS_LEVEL)


def algorithm_implied(values: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The ``algorithm`` section's :data:`cluster.spec.implied.Rule`: what its chosen variants imply (module doc)."""
    defaults = {s.name: AlgorithmSpec.model_fields[s.name].default for s in IMPLYING_SELECTORS}
    return implied_by_choices(values, IMPLYING_SELECTORS, defaults)


class AlgorithmSpec(BaseModel):
    """GRPO objective: advantage estimator, clipped policy loss, KL to the reference policy, rewards, sampling."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    IMPLIED: ClassVar[Rule] = staticmethod(algorithm_implied)

    # ---- advantages
    advantage_estimator: Annotated[str, ADVANTAGE_ESTIMATOR.validator] = Field(
        "grpo", strict=True, description=ADVANTAGE_ESTIMATOR.describe(
            "Group advantage", "grpo (mean/std), dr_grpo (mean only), rloo (leave-one-out mean)"))
    adv_eps: float = Field(1e-6, strict=True, gt=0, le=MAX_COEFFICIENT, description=(
        "Added to the group std before dividing (grpo); at most 1e6."))
    adv_std: Literal["unbiased", "biased"] = Field("unbiased", description="Group std with N-1 or N denominator.")
    # ---- policy loss
    policy_loss: Annotated[str, POLICY_LOSS.validator] = Field("ppo", strict=True, description=POLICY_LOSS.describe(
        "The policy-gradient term (formulas in grpo.policy_losses)", "ppo (token-level clipped surrogate), gspo "
        "(GSPO: the sequence's geometric-mean ratio, clipped per sequence; needs one advantage per sequence), "
        "gspo_token (GSPO-token: equal to gspo with per-sequence advantages, also takes kl_in_reward's per-token "
        "ones), cispo (CISPO: clipped, stop-gradient importance weight times the logprob; no dual_clip_c)"))
    loss_agg: Annotated[str, LOSS_AGGREGATION.validator] = Field(
        "seq-mean-token-mean", strict=True, description=LOSS_AGGREGATION.describe(
            "How per-token losses are reduced to one scalar (left out: seq-mean-token-sum-norm with "
            "advantage_estimator dr_grpo, Dr. GRPO's, else seq-mean-token-mean)", "token-mean, seq-mean-token-mean, "
            "seq-mean-token-sum-norm"))
    clip_eps_low: float = Field(0.2, strict=True, ge=0, lt=1, description=(
        "Lower ratio clip: ratio >= 1 - clip_eps_low. Left out, the policy loss's own value: 0.2 for ppo (a token "
        "ratio), 3e-4 for gspo and gspo_token (GSPO's range of a sequence-level ratio, Zheng et al. 2025), 0.999 for "
        "cispo (no lower bound on its weight, MiniMax-M1)."))
    clip_eps_high: float = Field(0.2, strict=True, ge=0, le=MAX_RATIO - 1, description=(
        "Upper ratio clip: ratio <= 1 + clip_eps_high; at most e^20 - 1 (the ratio is clamped at e^20). Left out, "
        "the policy loss's own value: 0.2 for ppo and cispo, 4e-4 for gspo and gspo_token (GSPO's range)."))
    dual_clip_c: float | None = Field(None, strict=True, gt=1, le=MAX_RATIO, description=(
        "Dual clip (Ye et al. 2020): for negative advantages the token loss is at most c·|A|, c in (1, e^20]; null "
        "disables."))
    entropy_coef: float = Field(0.0, strict=True, ge=0, le=MAX_COEFFICIENT, description=(
        "Weight of the entropy bonus, subtracted from the loss (the entropy's gradient trains the policy); at most "
        "1e6."))
    num_iterations: int = Field(1, ge=1, le=1024, strict=True, description=(
        "Optimizer steps per rollout batch; the behaviour logprobs of all of them are the trainer's, before the "
        "first step."))
    tis_cap: float | None = Field(None, strict=True, gt=0, le=MAX_RATIO, description=(
        "Truncated importance sampling: weight each token by min(pi_old_trainer / pi_engine, tis_cap), tis_cap in "
        "(0, e^20] (the ratio is clamped at e^20); null disables."))
    tis_level: Annotated[str, TIS_LEVEL.validator] = Field("token", strict=True, description=TIS_LEVEL.describe(
        "With tis_cap, how the truncated ratios weight the tokens (grpo.off_policy.importance_weights)",
        "token (each token by its own truncated ratio), sequence (every token of a sequence by min(product of its "
        "token ratios, tis_cap))"))
    mis: MisSpec | None = Field(None, description=(
        "Masked importance sampling: {level: a name in grpo.off_policy.MIS_LEVELS (built in: token, sequence), "
        "low, high}; tokens or sequences whose ratio pi_old_trainer / pi_engine is outside [low, high] leave the "
        "loss. null disables."))
    off_policy_correction: Literal["auto", "none"] = Field("auto", description=(
        "auto: in rollout.mode one_step_off and async, when neither tis_cap nor mis is set, weight each token by "
        f"min(pi_old_trainer / pi_engine, {DEFAULT_TIS_CAP:g}) (token-level truncated importance sampling against "
        "the engine that sampled it); nothing is added in sync mode or when tis_cap or mis is set. none: no "
        "correction by default: stale samples are trained as if on-policy (warned about by validate and at start; "
        "tis_cap and mis must then be null)."))
    # ---- KL to the reference policy
    kl_coef: float = Field(0.04, strict=True, ge=0, le=MAX_COEFFICIENT, description=(
        "beta: weight of the KL penalty to the reference policy (initial value when kl_controller is adaptive); at "
        "most 1e6."))
    kl_estimator: Annotated[str, KL_ESTIMATOR.validator] = Field("k3", strict=True, description=KL_ESTIMATOR.describe(
        "KL estimator", "k1, k2, k3 (Schulman's)"))
    kl_in_reward: bool = Field(False, strict=True, description=(
        "Put the KL in the reward as a per-token penalty (return-to-go added to the advantage) instead of the loss."))
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description=(
        "fixed: beta = kl_coef; adaptive: beta steered so the measured KL approaches kl_target (Ziegler et al. 2019)."))
    kl_target: float = Field(0.01, strict=True, gt=0, le=MAX_COEFFICIENT, description=(
        "Adaptive controller: target KL in nats per token."))
    kl_horizon_sequences: int = Field(10_000, ge=1, le=MAX_COUNT, strict=True, description=(
        "Adaptive controller horizon in sequences: beta moves by at most 20% x sequences trained per step (those "
        "with a token in the loss) / horizon."))
    # ---- rewards
    rewards: dict[str, StrictFloat] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.1}, description=(
        f"Reward function -> weight. A key is a registered name (builtins: {', '.join(REWARD_NAMES)}: "
        "docs/own_task.md), 'module:function', or 'path/to/file.py:function' (relative to the spec file); the "
        "function is called fn(prompts=..., completions=..., **columns) or fn(completions, references) and returns "
        "one finite float or None per completion: None where another weighted reward scores the row means 'does "
        "not apply' (TRL's convention: the row's total is the weighted sum of the rewards that scored it); a row no "
        "weighted reward scores has no reward (docs/own_task.md)."))
    reward_combine: Literal["sum-then-normalise", "normalise-then-sum"] = Field(
        "sum-then-normalise", description=(
            "sum-then-normalise: advantage of the weighted reward sum; normalise-then-sum: weighted sum of each "
            "reward's own group advantage."))
    reward_on_error: Literal["raise", "none"] = Field("raise", description=(
        "A reward function that raises: 'raise' fails the step naming it; 'none' gives the completions of its call "
        "no reward (counted in reward/failed), an infrastructure failure, even where another reward scored them."))
    max_infra_failed_fraction: float = Field(0.5, strict=True, ge=0, le=1, description=(
        "Completions without a reward (no weighted function scored them, or one raised with reward_on_error 'none': "
        "an infrastructure failure, not the policy's) are left out of their group's statistics, of the loss and of "
        "the step's metrics, and counted in reward/infra_failed. A sampling round (the step's batch, without "
        "dynamic sampling) where more than this fraction of completions have none stops the job naming this field; "
        "one where every completion has none always stops it. 0 stops at the first."))
    # ---- truncated completions
    mask_truncated: bool = Field(False, strict=True, description=(
        "Completions without EOS (cut at max_response_tokens) are masked out of the loss (DAPO overlong filtering)."))
    overlong_buffer_tokens: int | None = Field(None, ge=1, strict=True, description=(
        "DAPO soft overlong punishment: penalty ramps from 0 to -overlong_penalty_factor over the last this-many "
        "tokens before max_response_tokens; null disables."))
    overlong_penalty_factor: float = Field(1.0, strict=True, ge=0, le=MAX_COEFFICIENT, description=(
        "Scale of the overlong penalty (reward units); at most 1e6."))
    # ---- sampling
    dynamic_sampling: bool = Field(False, strict=True, description=(
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

    @model_validator(mode="wrap")
    @classmethod
    def _implied_settings(cls, data: Any, handler) -> AlgorithmSpec:
        """What the chosen variants imply when the spec leaves the setting out (module doc); a value the spec gives
        is kept and checked as written."""
        return with_implied(data, handler, algorithm_implied)

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
        heavy = {k: w for k, w in rewards.items() if abs(w) > MAX_COEFFICIENT}
        if heavy:
            raise ValueError(f"expected reward weights in [-{MAX_COEFFICIENT:g}, {MAX_COEFFICIENT:g}] (they scale "
                             f"float32 rewards), got {heavy}")
        return rewards  # none at all is refused by JobSpec unless the job has an agent (cluster.spec.agents)

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
    def _policy_loss_combinations(self) -> AlgorithmSpec:
        from grpo.policy_losses import sequence_advantages, supports_dual_clip

        if self.kl_in_reward and sequence_advantages(self.policy_loss):
            raise FieldConflict("algorithm.policy_loss", (
                f"policy_loss={self.policy_loss!r} needs one advantage per sequence, but algorithm.kl_in_reward=true "
                f"makes them per token; expected policy_loss 'gspo_token' (GSPO-token takes per-token advantages) or "
                f"kl_in_reward false"))
        if self.dual_clip_c is not None and not supports_dual_clip(self.policy_loss):
            raise FieldConflict("algorithm.dual_clip_c", (
                f"dual_clip_c={self.dual_clip_c!r} bounds a clipped surrogate's loss, and policy_loss="
                f"{self.policy_loss!r} has none (its clipped weight is bounded already); expected dual_clip_c null "
                f"with policy_loss {self.policy_loss!r}"))
        return self

    @model_validator(mode="after")
    def _none_means_none(self) -> AlgorithmSpec:
        chosen = [name for name, value in (("tis_cap", self.tis_cap), ("mis", self.mis)) if value is not None]
        if self.off_policy_correction == "none" and chosen:
            raise FieldConflict("algorithm.off_policy_correction", (
                f"'none' turns every behaviour correction off, but algorithm.{chosen[0]} is set; remove "
                f"off_policy_correction: none to use it, or set {' and '.join(chosen)} to null"))
        return self

    @model_validator(mode="after")
    def _adaptive_settings_need_the_controller(self) -> AlgorithmSpec:
        if self.kl_controller == "fixed":
            unused_when_off(self, ("kl_target", "kl_horizon_sequences"), "algorithm",
                            "algorithm.kl_controller: adaptive")
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


def _default_applies(alg: AlgorithmSpec, rollout) -> bool:
    """Whether the off-policy default (token TIS, cap :data:`DEFAULT_TIS_CAP`) is added for this spec."""
    return (rollout.mode in OFF_POLICY_MODES and alg.off_policy_correction == "auto" and alg.tis_cap is None
            and alg.mis is None)


def effective_algorithm(alg: AlgorithmSpec, rollout) -> AlgorithmSpec:
    """The algorithm the train ranks run: ``alg`` itself, or — in one_step_off/async with
    ``off_policy_correction: auto`` and neither ``tis_cap`` nor ``mis`` set — a copy with ``tis_cap`` =
    :data:`DEFAULT_TIS_CAP` at ``tis_level`` token (module doc). The spec is not changed.

    Args:
        alg: the spec's ``algorithm``. rollout: its ``rollout`` (``mode``).
    """
    if not _default_applies(alg, rollout):
        return alg
    return alg.model_copy(update={"tis_cap": DEFAULT_TIS_CAP, "tis_level": "token"})


def describe_off_policy(alg: AlgorithmSpec, rollout) -> str:
    """One line: how far behind the samples of ``rollout.mode`` may be and which behaviour correction the train
    ranks apply (``grpo-cluster validate`` prints it)."""
    if rollout.mode not in OFF_POLICY_MODES:
        return f"rollout.mode {rollout.mode}: on-policy samples; no behaviour correction added"
    behind = 1 if rollout.mode == "one_step_off" else rollout.max_staleness
    head = f"rollout.mode {rollout.mode}: samples up to {behind} policy version(s) old; "
    run = effective_algorithm(alg, rollout)
    if _default_applies(alg, rollout):
        return head + f"token-level TIS, cap {run.tis_cap:g} (the default, algorithm.off_policy_correction: auto)"
    parts = []
    if run.tis_cap is not None:
        parts.append(f"{run.tis_level}-level TIS, cap {run.tis_cap:g}")
    if run.mis is not None:
        parts.append(f"{run.mis.level}-level MIS, band [{run.mis.low:g}, {run.mis.high:g}]")
    return head + (" + ".join(parts) if parts else "NO behaviour correction (algorithm.off_policy_correction: none)")


def off_policy_warning(alg: AlgorithmSpec, rollout) -> str | None:
    """A warning for a job that trains stale samples with no behaviour correction at all (one_step_off/async with
    ``off_policy_correction: none``); None otherwise."""
    if rollout.mode not in OFF_POLICY_MODES or alg.off_policy_correction != "none":
        return None
    behind = 1 if rollout.mode == "one_step_off" else rollout.max_staleness
    return (f"algorithm.off_policy_correction: none with rollout.mode {rollout.mode}: samples up to {behind} policy "
            f"version(s) old are trained as if on-policy (no weight depends on the engine's behaviour logprobs); "
            f"remove it for the default token-level TIS (cap {DEFAULT_TIS_CAP:g}), or set algorithm.tis_cap / "
            f"algorithm.mis")
