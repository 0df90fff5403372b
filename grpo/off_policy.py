"""Off-policy correction between the behaviour policy (the rollout engine that sampled the tokens) and the trainer's
proximal policy, plus the metrics that describe how far apart they are.

Shapes:
    N   sequences, T response tokens (padded)

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; used for asynchronous RL by
AReaL, Fu et al. 2025): three policies appear in the objective. The *behaviour* policy π_b sampled the tokens (the
engine; its logprobs come with the rollout, possibly several policy versions old and computed with other kernels);
the *proximal* policy π_prox is the trainer's policy at the start of the step (the "old" logprobs of
``grpo.losses.policy_loss``); the current policy π_θ is being optimised. The PPO clip keeps π_θ near π_prox, while
the importance ratio

    ρ_t = π_prox(y_t) / π_b(y_t) = exp(clamp(old_t − behaviour_t, −20, 20))

re-weights (or filters) the sampled tokens so the gradient estimates the objective under π_prox although the tokens
came from π_b. A token whose behaviour logprob is not finite (NaN/±inf from a faulty engine kernel) has no usable
ratio: it gets ρ = 1, i.e. no correction (it is never truncated away nor masked), as
``grpo.losses.truncated_importance_weights`` has always done; the driver counts such tokens.

Two ways to use ρ:
- TIS, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
  RL Training", fengyao.notion.site; truncation after IMPALA, Espeholt et al. 2018): the pg term is multiplied by a
  weight min(ρ, C). Token level weights each token by its own ρ_t; sequence level weights every token of sequence i by
  the ratio of the whole response, min(Π_t ρ_t, C) = min(exp(Σ_t log ρ_t), C): unbiased for sequence-level rewards
  before truncation, but its variance grows with the length.
- MIS, masked importance sampling (the same line of work, and verl's rollout importance-sampling "mask" mode):
  instead of re-weighting, samples whose ratio lies outside a band [low, high] are dropped from the loss (a form of
  rejection sampling: where π_b and π_prox disagree this much the sample says little about π_prox). Token level drops
  single tokens; sequence level drops a whole sequence when its geometric-mean ratio exp(mean_t log ρ_t) — a
  length-normalised sequence ratio, so long responses are not dropped just for being long — is outside the band.

Every function here is pure torch on tensors (no Ray, no ``torch.distributed``); the trainer sums their outputs over
micro-batches and ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

from grpo.losses import LOG_RATIO_CLAMP, truncated_importance_weights

OffPolicyLevel = Literal["token", "sequence"]

__all__ = [
    "OffPolicyLevel",
    "behaviour_kl_k3",
    "check_mis_band",
    "importance_log_ratio",
    "importance_weights",
    "masked_fraction",
    "mis_keep_mask",
    "ratio_quantiles",
    "sequence_log_ratio",
    "staleness_histogram",
]

_LEVELS = ("token", "sequence")


def _as_bool_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"response_mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _check_level(level: str) -> None:
    if level not in _LEVELS:
        raise ValueError(f"level must be one of {', '.join(_LEVELS)}, got {level!r}")


def importance_log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log importance ratio log ρ_t = clamp(old − behaviour, −20, 20) of the proximal over the behaviour
    policy (formula and sources: module doc).

    Args:
        old_logprobs: [N, T] float, the proximal (trainer, pre-update) policy's logprobs of the sampled tokens.
        behaviour_logprobs: [N, T] float, the engine's logprobs of the same tokens.
        response_mask: [N, T] bool or float (nonzero = valid response token).

    Returns:
        (log_ratio: [N, T] float32, detached, 0 where the token is masked or its behaviour logprob is not finite
        (ratio 1: no correction); known: [N, T] bool, valid tokens with a finite behaviour logprob).

    Raises:
        ValueError: shapes differ or are not [N, T].
    """
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be [N, T], got shape {tuple(old_logprobs.shape)}")
    if behaviour_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"behaviour_logprobs must have shape {tuple(old_logprobs.shape)} like old_logprobs, "
                         f"got {tuple(behaviour_logprobs.shape)}")
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    behaviour = behaviour_logprobs.detach().float()
    known = mask & torch.isfinite(behaviour)
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs.device)
    diff = torch.where(known, old_logprobs.detach().float() - behaviour, zero)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), known


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                       reduce: Literal["sum", "mean"]) -> torch.Tensor:
    """Per-sequence log ratio from per-token ones (:func:`importance_log_ratio`).

    ``sum``: log Π_t ρ_t (the sequence importance ratio, sequence-level TIS); ``mean``: log of the geometric mean
    ratio, Σ_t log ρ_t / (valid tokens), sequence-level MIS. Tokens with no behaviour logprob count with log ρ = 0.

    Args:
        log_ratio: [N, T] float32, 0 at masked positions. response_mask: [N, T] bool or float.
        reduce: "sum" or "mean".

    Returns:
        [N] float32; 0 for a sequence with no valid token (ratio 1).

    Raises:
        ValueError: shapes or an unknown ``reduce``.
    """
    mask = _as_bool_mask(response_mask, log_ratio.shape)
    total = torch.where(mask, log_ratio.float(), torch.zeros((), device=log_ratio.device)).sum(dim=-1)
    if reduce == "sum":
        return total
    if reduce == "mean":
        return total / mask.sum(dim=-1).to(torch.float32).clamp(min=1.0)
    raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       cap: float, level: OffPolicyLevel = "token") -> torch.Tensor:
    """Truncated importance-sampling (TIS) weights multiplying the pg term (Yao et al. 2025; module doc).

        token:     w_t = min(ρ_t, C)                                   (``grpo.losses.truncated_importance_weights``)
        sequence:  w_t = min(exp(clamp(Σ_s log ρ_s, −20, 20)), C) for every token t of the sequence

    Args:
        old_logprobs, behaviour_logprobs: [N, T] float (see :func:`importance_log_ratio`).
        response_mask: [N, T] bool or float (nonzero = valid).
        cap: C, finite and > 0.
        level: "token" or "sequence".

    Returns:
        [N, T] float32 in [0, C], detached, finite; 0 at masked positions. A sequence whose every behaviour logprob
        is non-finite has weight min(1, C).

    Raises:
        ValueError: shapes, cap not finite and > 0, unknown level.
    """
    _check_level(level)
    if level == "token":
        return truncated_importance_weights(old_logprobs, behaviour_logprobs, response_mask, cap)
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"cap must be finite and > 0, got {cap!r}")
    log_ratio, _ = importance_log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    seq = sequence_log_ratio(log_ratio, mask, "sum").clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weights = torch.exp(seq).clamp(max=cap).unsqueeze(-1).expand(mask.shape)
    return torch.where(mask, weights, torch.zeros((), dtype=torch.float32, device=weights.device))


def check_mis_band(low: float, high: float) -> None:
    """Raise ``ValueError`` unless 0 < low < high < inf (both finite numbers), naming the bad bound."""
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"MIS band {name} must be a finite number in (0, inf), got {value!r}")
    if not low < high:
        raise ValueError(f"MIS band must have low < high, got low={low!r}, high={high!r}")


def mis_keep_mask(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                  low: float, high: float, level: OffPolicyLevel = "token") -> torch.Tensor:
    """Masked importance sampling (MIS): which valid tokens stay in the loss (module doc).

        token:     keep t  ⇔  low ≤ ρ_t ≤ high  (or t has no finite behaviour logprob: no correction)
        sequence:  keep every token of i  ⇔  low ≤ exp(mean_t log ρ_t) ≤ high   (geometric-mean ratio)

    The band is closed. The caller aggregates the loss over the returned mask, so a dropped token leaves both the
    sum and the token/sequence counts (``grpo.losses.aggregate_loss`` with the mask and counts of kept tokens).

    Args:
        old_logprobs, behaviour_logprobs: [N, T] float (see :func:`importance_log_ratio`).
        response_mask: [N, T] bool or float (nonzero = valid).
        low, high: the band, 0 < low < high < inf.
        level: "token" or "sequence".

    Returns:
        [N, T] bool, a subset of ``response_mask``.

    Raises:
        ValueError: shapes, a band not inside (0, inf) or low >= high, unknown level.
    """
    check_mis_band(low, high)
    _check_level(level)
    log_ratio, known = importance_log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    log_low, log_high = math.log(low), math.log(high)
    if level == "token":
        inside = (log_ratio >= log_low) & (log_ratio <= log_high)
        return mask & (inside | ~known)
    seq = sequence_log_ratio(log_ratio, mask, "mean")
    inside = (seq >= log_low) & (seq <= log_high)
    return mask & inside.unsqueeze(-1)


def masked_fraction(keep_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Fraction of valid response tokens that MIS dropped: |valid ∧ ¬keep| / |valid| (0 when none is valid).

    Args:
        keep_mask: [N, T] bool (:func:`mis_keep_mask`). response_mask: [N, T] bool or float.

    Returns:
        0-d float32.

    Raises:
        ValueError: shapes differ.
    """
    mask = _as_bool_mask(response_mask, keep_mask.shape)
    dropped = (mask & ~keep_mask.bool()).sum().to(torch.float32)
    return dropped / mask.sum().to(torch.float32).clamp(min=1.0)


def ratio_quantiles(log_ratio: torch.Tensor, known: torch.Tensor,
                    quantiles: Iterable[float] = (0.0, 0.01, 0.5, 0.99, 1.0)) -> torch.Tensor:
    """Quantiles of the importance ratio ρ over the tokens in ``known`` (linear interpolation, ``torch.quantile``).

    Exact for the tokens given; quantiles of several micro-batches or ranks cannot be combined from theirs (only the
    min and max, q = 0 and 1, reduce), so a trainer computing them per micro-batch reports min/max instead.

    Args:
        log_ratio: [N, T] float (:func:`importance_log_ratio`). known: [N, T] bool, the tokens to include.
        quantiles: probabilities in [0, 1].

    Returns:
        [len(quantiles)] float32 ratios (not logs); NaN when no token is known.

    Raises:
        ValueError: shapes differ, or a probability outside [0, 1].
    """
    qs = torch.tensor(list(quantiles), dtype=torch.float32, device=log_ratio.device)
    if qs.numel() == 0 or bool(((qs < 0) | (qs > 1) | torch.isnan(qs)).any()):
        raise ValueError(f"quantiles must be a non-empty list of probabilities in [0, 1], got {qs.tolist()}")
    known = _as_bool_mask(known, log_ratio.shape)
    values = torch.exp(log_ratio.detach().float()[known])
    if values.numel() == 0:
        return torch.full_like(qs, float("nan"))
    return torch.quantile(values, qs)


def behaviour_kl_k3(current_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                    response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimate of KL(π_b ‖ π_θ), the behaviour policy against the trainer's, on the sampled tokens.

        k3_t = r_t − 1 − log r_t,   r_t = π_θ(y_t) / π_b(y_t) = exp(clamp(current − behaviour, −20, 20))

    The tokens were sampled from π_b, so this is Schulman's k3 (J. Schulman 2020, "Approximating KL Divergence")
    with π_b as the sampling distribution: E_{y∼π_b}[r − 1] = 0 and E_{y∼π_b}[−log r] = KL(π_b ‖ π_θ), so k3 is
    unbiased for that direction, and it is ≥ 0 for every token with lower variance than k1 = −log r (which can be
    negative token by token). The other direction, KL(π_θ ‖ π_b), would need samples from π_θ.

    Args:
        current_logprobs: [N, T] float, the trainer's logprobs of the sampled tokens (the proximal policy's).
        behaviour_logprobs: [N, T] float, the engine's.
        response_mask: [N, T] bool or float.

    Returns:
        (k3: [N, T] float32, detached, ≥ 0, 0 where not known; known: [N, T] bool, valid tokens with a finite
        behaviour logprob — average k3 over these).

    Raises:
        ValueError: shapes.
    """
    log_r, known = importance_log_ratio(current_logprobs, behaviour_logprobs, response_mask)
    k3 = torch.expm1(log_r) - log_r
    return torch.where(known, k3, torch.zeros((), dtype=torch.float32, device=k3.device)), known


def staleness_histogram(staleness: Iterable[int] | torch.Tensor) -> dict[int, int]:
    """Counts per staleness value: {policy versions behind: number of samples}, keys ascending.

    Args:
        staleness: per-sample staleness (trainer policy version − the version a sample was generated under), a
            sequence of ints or a 1-D integer tensor; each >= 0.

    Returns:
        dict of int → int, only values that occur (empty input gives {}).

    Raises:
        ValueError: a negative, non-integer or boolean value, or a tensor that is not 1-D of an integer dtype.
    """
    if isinstance(staleness, torch.Tensor):
        if staleness.dim() != 1 or staleness.dtype.is_floating_point or staleness.dtype.is_complex \
                or staleness.dtype == torch.bool:
            raise ValueError(f"staleness must be a 1-D integer tensor, got shape {tuple(staleness.shape)} "
                             f"dtype {staleness.dtype}")
        values = [int(v) for v in staleness.tolist()]
    else:
        values = list(staleness)
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise ValueError(f"staleness values must be ints, got {bad[:5]!r}")
    negative = sorted({v for v in values if v < 0})
    if negative:
        raise ValueError(f"staleness must be >= 0 (versions behind), got {negative[:5]}")
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items()))
