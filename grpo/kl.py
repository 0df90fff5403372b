"""Per-token KL penalty estimators between the policy and the reference policy, and KL-coefficient controllers.

Shapes:
    N   sequences, T response tokens

The estimators are Monte-Carlo estimates of KL(π_θ ‖ π_ref) from tokens sampled from π_θ (or the behaviour policy),
after J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html:
    k1 = log π_θ − log π_ref                      unbiased, high variance, can be negative
    k2 = ½ (log π_θ − log π_ref)²                 biased, low variance, ≥ 0
    k3 = exp(d) − d − 1,  d = log π_ref − log π_θ  unbiased, low variance, ≥ 0 (used by GRPO, Shao et al. 2024)

The estimators are elementwise; masking padded positions is the caller's job (`grpo.losses.policy_loss` replaces
them with `torch.where` before calling, so NaN/Inf at padding never leaks into values or gradients).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch

from grpo.registry import Registry

KLEstimatorName = Literal["k1", "k2", "k3"]

#: k3's log-ratio d is clamped to [-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP] before exp, so the value stays finite.
K3_LOG_RATIO_CLAMP = 20.0

__all__ = [
    "K3_LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLEstimatorName",
    "kl_penalty",
    "kl_reward_advantages",
    "make_kl_controller",
    "register_kl_estimator",
]


class KLEstimator(Protocol):
    def __call__(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor: ...


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def register_kl_estimator(name: str):
    """Decorator adding an estimator to `KL_ESTIMATORS`; a duplicate name raises `ValueError`."""
    return KL_ESTIMATORS.register(name)


@register_kl_estimator("k1")
def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log π_θ − log π_ref (Schulman 2020)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π_θ − log π_ref)² (Schulman 2020)."""
    diff = logprobs - ref_logprobs
    return 0.5 * diff * diff


@register_kl_estimator("k3")
def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) − d − 1 with d = clamp(log π_ref − log π_θ, −20, 20) (Schulman 2020).

    Computed as expm1(d) − d, which keeps precision for small |d| (exp(d) − 1 rounds to 0 in float32 for
    |d| < 6e-8 and would give small negative values); the result is clamped at 0 against residual rounding.
    """
    d = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(d) - d).clamp(min=0.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimatorName = "k3") -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate.

    Args:
        logprobs: [N, T] (any shape) float32, natural-log probabilities of the sampled tokens under the policy.
        ref_logprobs: same shape and dtype, under the reference policy.
        estimator: a name in `KL_ESTIMATORS` ("k1", "k2", "k3"; Schulman 2020).

    Returns:
        [N, T] tensor of the inputs' dtype; differentiable w.r.t. both inputs (detach `ref_logprobs` yourself).
        "k3" is ≥ 0 and finite for any finite inputs.

    Raises:
        ValueError: shape mismatch or unknown estimator.
    """
    fn = KL_ESTIMATORS.lookup(estimator)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have the same shape, got {tuple(logprobs.shape)} "
            f"and {tuple(ref_logprobs.shape)}"
        )
    return fn(logprobs, ref_logprobs)


def kl_reward_advantages(
    advantages: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token advantages with the KL penalty moved from the loss into the reward.

    PPO-RLHF puts the KL in the reward: every token t earns r_t = −β·kl_t, plus the outcome reward at the end
    (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"; Ouyang et al. 2022, "Training
    language models to follow instructions with human feedback", eq. 2). Without a value function and with
    γ = λ = 1, the advantage of token t is its return-to-go, so the group-relative outcome advantage A gains the
    penalties of token t and every later token of the same sequence:

        A_t = A − β · Σ_{t' ≥ t, valid} kl_{t'}

    (the causal REINFORCE form: token t's choice cannot change earlier penalties). The KL is a reward here, so it
    is detached; the loss then takes `kl_coef = 0`.

    Args:
        advantages: [N] (or [N, T]) float32 outcome advantages.
        kl: [N, T] float32 per-token KL estimates (`kl_penalty` of the behaviour vs reference logprobs).
        response_mask: [N, T] bool or float (nonzero = valid token); masked positions are ignored, even NaN/Inf.
        kl_coef: β, finite.

    Returns:
        [N, T] float32 per-token advantages, 0 where the mask is 0.

    Raises:
        ValueError: shapes or a non-finite kl_coef.
    """
    if kl.dim() != 2:
        raise ValueError(f"kl must be [N, T], got shape {tuple(kl.shape)}")
    if response_mask.shape != kl.shape:
        raise ValueError(f"response_mask must have shape {tuple(kl.shape)} like kl, got {tuple(response_mask.shape)}")
    if not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef must be finite, got {kl_coef!r}")
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    if advantages.shape == kl.shape:
        adv = advantages
    elif advantages.dim() == 1 and advantages.shape[0] == kl.shape[0]:
        adv = advantages.unsqueeze(-1).expand(kl.shape)
    else:
        raise ValueError(f"advantages must have shape ({kl.shape[0]},) or {tuple(kl.shape)}, "
                         f"got {tuple(advantages.shape)}")
    zero = torch.zeros((), dtype=torch.float32, device=kl.device)
    penalty = torch.where(mask, kl.detach().to(torch.float32), zero)
    to_go = penalty.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, adv.detach().to(torch.float32) - kl_coef * to_go, zero)


class KLController(Protocol):
    """Holds the KL coefficient β (`kl_coef`); `update` is called once per training step."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant β.

    Args:
        kl_coef: β ≥ 0.
    """

    def __init__(self, kl_coef: float) -> None:
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef!r}")
        self._value = float(kl_coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers are interchangeable)."""

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from :meth:`state_dict` (checkpoint resume); raises ValueError if it is not finite and >= 0."""
        value = float(state["kl_coef"])
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {value!r}")
        self._value = value


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards a target.

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. (2):
        e_t = clip(KL_t / KL_target − 1, −0.2, 0.2),   β_{t+1} = β_t · (1 + K_β · e_t)
    with K_β = n_steps / horizon (n_steps: samples or steps since the last update, in the same unit as horizon).

    Args:
        init_kl_coef: initial β > 0 (a β of 0 would stay 0 forever).
        target_kl: KL_target > 0, in nats per token (match the unit of `current_kl`).
        horizon: > 0, in the unit of `n_steps`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        for name, v in (("init_kl_coef", init_kl_coef), ("target_kl", target_kl), ("horizon", horizon)):
            if not (math.isfinite(v) and v > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")
        self._value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply β by 1 + clip(current_kl / target_kl − 1, −0.2, 0.2) · n_steps / horizon.

        Args:
            current_kl: measured KL (Python float or 0-d tensor), finite.
            n_steps: ≥ 0, samples (or steps) since the last update.
        """
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"current_kl must be finite, got {kl!r}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self._value *= 1.0 + error * n_steps / self.horizon

    state_dict = FixedKLController.state_dict
    load_state_dict = FixedKLController.load_state_dict


def make_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: float) -> KLController:
    """The β controller ``algorithm.kl_controller`` names: "fixed" (:class:`FixedKLController` at ``kl_coef``) or
    "adaptive" (:class:`AdaptiveKLController` from ``kl_coef`` towards ``target_kl`` over ``horizon`` sequences).

    Raises:
        ValueError: another kind, or the controller's own argument errors.
    """
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_controller must be 'fixed' or 'adaptive', got {kind!r}")
