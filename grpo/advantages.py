"""Group-relative advantage estimators (outcome rewards, one scalar per sequence).

Shapes:
    N   sequences in the batch (B prompts × G completions, groups may be uneven)
    K   distinct group ids in the batch

Inputs are one reward per sequence and an explicit group id per sequence, so rows may be in any order (reordering
for load balance is safe) and groups may have any size. A NaN reward means "no valid reward" (e.g. a reward function
failed): that row is left out of its group's statistics and gets advantage 0.

Group statistics are computed with `index_add_` in two passes (mean first, then the sum of squared deviations from
that mean), in float64, never as E[x²] − E[x]², which cancels catastrophically when rewards are close together.

Guarantees for every estimator: a group whose valid rewards are all equal (including a group with fewer than two
valid rewards) gives exactly 0.0 to all its members; invalid (NaN) rows give exactly 0.0; no output is NaN or Inf.

New estimators register with `@register_advantage_estimator("name")`; they receive the float64 rewards (invalid rows
filled with 0) and the `GroupStats`, and the zeroing above is applied to their output afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch

from grpo.registry import Registry, set_implied

AdvantageEstimatorName = Literal["grpo", "dr_grpo", "rloo"]
StdKind = Literal["unbiased", "biased"]
RewardCombineName = Literal["sum-then-normalise", "normalise-then-sum"]

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimatorName",
    "GroupStats",
    "RewardCombineName",
    "StdKind",
    "all_equal_fraction",
    "compute_advantages",
    "compute_group_stats",
    "compute_multi_reward_advantages",
    "group_all_equal_mask",
    "register_advantage_estimator",
]


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics over the valid (non-NaN) rewards.

    Attributes:
        group_index: [N] int64, dense group index in [0, K) of each row; groups are numbered in ascending order of
            their original group id (`torch.unique` order).
        valid: [N] bool, True where the reward is not NaN.
        count: [K] float64, number of valid rewards in the group.
        mean: [K] float64, mean of the valid rewards; 0 for a group with no valid reward.
        sq_dev_sum: [K] float64, Σ (r − mean)² over valid rewards (second pass, numerically stable).
        all_equal: [K] bool, True when the group's valid rewards are all equal or it has fewer than two of them.
    """

    group_index: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    sq_dev_sum: torch.Tensor
    all_equal: torch.Tensor

    def std(self, kind: StdKind) -> torch.Tensor:
        """[K] float64 standard deviation: "unbiased" divides by (n − 1), "biased" by n; 0 for groups with n < 2."""
        if kind == "unbiased":
            denom = (self.count - 1.0).clamp(min=1.0)
        elif kind == "biased":
            denom = self.count.clamp(min=1.0)
        else:
            raise ValueError(f"std must be one of {list(get_args(StdKind))}, got {kind!r}")
        var = torch.where(self.count >= 2, self.sq_dev_sum / denom, torch.zeros_like(self.sq_dev_sum))
        return var.sqrt()


class AdvantageEstimator(Protocol):
    def __call__(self, rewards: torch.Tensor, stats: GroupStats, *, eps: float, std: StdKind) -> torch.Tensor:
        """rewards: [N] float64 (invalid rows hold 0). Returns [N] float64 advantages."""
        ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage_estimator(name: str, *, implies: Mapping[str, Any] | None = None, why: str = ""):
    """Decorator adding an estimator to `ADVANTAGE_ESTIMATORS`; a duplicate name raises `ValueError`. ``implies``:
    settings of the spec's ``algorithm`` section that choosing it implies unless the spec sets them, with ``why``
    (its source; `grpo.registry.set_implied`)."""
    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        return ADVANTAGE_ESTIMATORS.register(name)(set_implied(fn, implies, why))

    return decorator


def _check_inputs(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    if group_ids.dim() != 1 or group_ids.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"group_ids must be 1-D with the same length as rewards {tuple(rewards.shape)}, "
            f"got shape {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if torch.isinf(rewards).any():
        raise ValueError(
            f"rewards contain {int(torch.isinf(rewards).sum())} ±Inf values; use NaN to mark a missing reward"
        )


def compute_group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Two-pass per-group statistics of the valid rewards.

    Args:
        rewards: [N] float (any float dtype), NaN = no valid reward. ±Inf raises `ValueError`.
        group_ids: [N] integer, arbitrary (unordered, non-contiguous, possibly negative) group ids.

    Returns:
        `GroupStats` with float64 statistics on the rewards' device.
    """
    _check_inputs(rewards, group_ids)
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)
    group_index = group_index.to(torch.int64)
    num_groups = unique_ids.numel()

    r = rewards.to(torch.float64)
    valid = ~torch.isnan(r)
    r = torch.where(valid, r, torch.zeros_like(r))
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)

    count = zeros.index_add(0, group_index, valid.to(torch.float64))
    total = zeros.index_add(0, group_index, r)
    mean = total / count.clamp(min=1.0)
    dev = torch.where(valid, r - mean[group_index], torch.zeros_like(r))
    sq_dev_sum = zeros.index_add(0, group_index, dev * dev)

    big = torch.finfo(torch.float64).max
    r_for_min = torch.where(valid, r, torch.full_like(r, big))
    r_for_max = torch.where(valid, r, torch.full_like(r, -big))
    gmin = torch.full_like(zeros, big).scatter_reduce(0, group_index, r_for_min, reduce="amin")
    gmax = torch.full_like(zeros, -big).scatter_reduce(0, group_index, r_for_max, reduce="amax")
    all_equal = (count < 2) | (gmin == gmax)

    return GroupStats(
        group_index=group_index, valid=valid, count=count, mean=mean, sq_dev_sum=sq_dev_sum, all_equal=all_equal
    )


@register_advantage_estimator("grpo")
def _grpo(rewards: torch.Tensor, stats: GroupStats, *, eps: float, std: StdKind) -> torch.Tensor:
    """A_i = (r_i − mean_g) / (std_g + eps). Source: DeepSeekMath (Shao et al. 2024), outcome supervision."""
    idx = stats.group_index
    return (rewards - stats.mean[idx]) / (stats.std(std)[idx] + eps)


@register_advantage_estimator("dr_grpo", implies={"loss_agg": "seq-mean-token-sum-norm"}, why=(
    "Dr. GRPO removes the length normalisation with the std's: token losses summed over a constant, sequences x "
    "max_response_tokens (Liu et al. 2025, 'Understanding R1-Zero-Like Training', sec. 3.2)"))
def _dr_grpo(rewards: torch.Tensor, stats: GroupStats, *, eps: float, std: StdKind) -> torch.Tensor:
    """A_i = r_i − mean_g (no std division). Source: Liu et al. 2025, "Understanding R1-Zero-like Training"."""
    return rewards - stats.mean[stats.group_index]


@register_advantage_estimator("rloo")
def _rloo(rewards: torch.Tensor, stats: GroupStats, *, eps: float, std: StdKind) -> torch.Tensor:
    """A_i = r_i − mean of the other n − 1 valid members = n/(n − 1) · (r_i − mean_g).

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO baseline).
    The centred form avoids subtracting two large sums. Groups with n < 2 are zeroed by the caller.
    """
    idx = stats.group_index
    n = stats.count[idx]
    scale = n / (n - 1.0).clamp(min=1.0)
    return scale * (rewards - stats.mean[idx])


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: AdvantageEstimatorName = "grpo",
    *,
    eps: float = 1e-6,
    std: StdKind = "unbiased",
) -> torch.Tensor:
    """Per-sequence advantages from outcome rewards, normalised within each group.

    Args:
        rewards: [N] float32 (any float dtype), one scalar reward per sequence; NaN = no valid reward (excluded from
            its group's statistics, advantage 0). ±Inf raises `ValueError`.
        group_ids: [N] int64, explicit group id per sequence (groups may be uneven, unordered, of size 1).
        estimator: a name in `ADVANTAGE_ESTIMATORS`: "grpo" (Shao et al. 2024), "dr_grpo" (Liu et al. 2025),
            "rloo" (Ahmadian et al. 2024).
        eps: added to the group std in "grpo" (not inside the square root).
        std: "unbiased" (divide by n − 1) or "biased" (divide by n); used by "grpo".

    Returns:
        [N] float32 advantages on the rewards' device; exactly 0.0 for NaN rows and for every member of a group whose
        valid rewards are all equal (or that has fewer than two); never NaN or Inf.

    Raises:
        ValueError: bad shapes/dtypes, ±Inf rewards, unknown estimator or std kind, negative eps.
    """
    fn = ADVANTAGE_ESTIMATORS.lookup(estimator)
    if std not in get_args(StdKind):
        raise ValueError(f"std must be one of {list(get_args(StdKind))}, got {std!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    stats = compute_group_stats(rewards, group_ids)
    r = torch.where(stats.valid, rewards.to(torch.float64), torch.zeros((), dtype=torch.float64, device=rewards.device))
    adv = fn(r, stats, eps=eps, std=std)
    if adv.shape != rewards.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(adv.shape)}, expected {tuple(rewards.shape)}"
        )
    keep = stats.valid & ~stats.all_equal[stats.group_index] & torch.isfinite(adv)
    return torch.where(keep, adv, torch.zeros_like(adv)).to(torch.float32)


def group_all_equal_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[K] bool: True for groups whose valid rewards are all equal or that have fewer than two valid rewards.

    Groups are ordered by ascending group id (the order of `torch.unique(group_ids)`). Such groups carry no
    learning signal (all advantages 0); dynamic sampling (DAPO, Yu et al. 2025) filters or resamples them.
    """
    return compute_group_stats(rewards, group_ids).all_equal


def all_equal_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction in [0, 1] of groups whose valid rewards are all equal (groups with < 2 valid rewards count as
    all-equal); 0.0 for an empty batch. Synchronises with the device (returns a Python float)."""
    mask = group_all_equal_mask(rewards, group_ids)
    if mask.numel() == 0:
        return 0.0
    return float(mask.to(torch.float64).mean())


def compute_multi_reward_advantages(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor,
    estimator: AdvantageEstimatorName = "grpo",
    *,
    combine: RewardCombineName = "sum-then-normalise",
    eps: float = 1e-6,
    std: StdKind = "unbiased",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages from several weighted reward functions.

    With w_k the weights, r_k the rewards of function k and `est` the group estimator (`compute_advantages`):
        "sum-then-normalise":  A = est(Σ_k w_k·r_k)          the usual GRPO: one scalar reward per completion
        "normalise-then-sum":  A = Σ_k w_k·est(r_k)          each reward normalised within its group first, so a
            reward with a large spread cannot drown a small one (MO-GRPO, Ichihara et al. 2025; GDPO; TRL's
            ``multi_objective_aggregation="normalize_then_sum"``). All-equal groups of a function contribute 0.
    Functions with weight 0 are ignored. A NaN reward (None) means the function does not apply to that row (TRL's
    convention): the sums run over the functions that apply (TRL's nansum), and under normalise-then-sum function k
    is normalised over the valid rows of the group it applies to and adds nothing where it does not (TRL's nanmean
    and nanstd per function). A row that is not ``valid`` is excluded from every group's statistics and has advantage
    0 (as in `compute_advantages`).

    Args:
        rewards: name → [N] float rewards (NaN = none); every name in `weights` must be present.
        weights: name → finite weight.
        group_ids, estimator, eps, std: as in `compute_advantages`.
        valid: [N] bool, the rows that have a reward (the loop passes the rows whose total is not NaN, so that a row
            whose weighted function raised is invalid even where another one scored it); None: the rows at least one
            weighted function scored.

    Returns:
        [N] float32 advantages, never NaN or Inf; exactly 0 for invalid rows and for groups whose weighted
        functions are all-equal.

    Raises:
        ValueError: empty or non-finite weights, a missing or misshapen reward or ``valid``, an unknown combine mode,
            plus the errors of `compute_advantages`.
    """
    if combine not in get_args(RewardCombineName):
        raise ValueError(f"combine must be one of {list(get_args(RewardCombineName))}, got {combine!r}")
    if not weights:
        raise ValueError("weights must name at least one reward function, got none")
    n = group_ids.shape[0]
    used = {}
    for name, w in weights.items():
        if not math.isfinite(w):
            raise ValueError(f"weight of reward {name!r} must be finite, got {w!r}")
        if name not in rewards:
            raise ValueError(f"weights name reward {name!r} but rewards hold only {sorted(rewards)}")
        r = rewards[name]
        if r.dim() != 1 or r.shape[0] != n:
            raise ValueError(f"reward {name!r} must have shape ({n},) like group_ids, got {tuple(r.shape)}")
        if w != 0.0:
            used[name] = (float(w), r.to(torch.float64))
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (n,)):
        raise ValueError(f"valid must be a bool tensor of shape ({n},) like group_ids, got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    if not used:
        return torch.zeros(n, dtype=torch.float32, device=group_ids.device)
    scored = torch.zeros(n, dtype=torch.bool, device=group_ids.device)
    for _, r in used.values():
        scored |= ~torch.isnan(r)
    invalid = ~scored if valid is None else ~(valid.to(group_ids.device) & scored)
    nan = torch.tensor(math.nan, dtype=torch.float64, device=group_ids.device)
    if combine == "sum-then-normalise":
        total = sum(w * torch.where(torch.isnan(r), 0.0, r) for w, r in used.values())  # nansum; ±inf raises
        return compute_advantages(torch.where(invalid, nan, total), group_ids, estimator, eps=eps, std=std)
    adv = torch.zeros(n, dtype=torch.float64, device=group_ids.device)
    for w, r in used.values():
        adv += w * compute_advantages(torch.where(invalid, nan, r), group_ids, estimator, eps=eps, std=std).double()
    return adv.to(torch.float32)
