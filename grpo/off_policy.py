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

The levels are named registries, :data:`TIS_LEVELS` and :data:`MIS_LEVELS` (built in: token, sequence), which the
spec's ``algorithm.tis_level`` and ``algorithm.mis.level`` select from; ``@register_tis_level("name")`` /
``@register_mis_level("name")`` add one.

Every function here is pure torch on tensors (no Ray, no ``torch.distributed``); the trainer sums their outputs over
micro-batches and ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, Protocol

import torch

from grpo.losses import LOG_RATIO_CLAMP, truncated_importance_weights
from grpo.registry import Registry

#: The built-in levels of both registries below (a type for callers; the registries own the selectable names).
OffPolicyLevel = Literal["token", "sequence"]

__all__ = [
    "MIS_LEVELS",
    "TIS_LEVELS",
    "OffPolicyLevel",
    "behaviour_kl_k3",
    "check_mis_band",
    "importance_log_ratio",
    "importance_weights",
    "masked_fraction",
    "mis_keep_mask",
    "ratio_quantiles",
    "register_mis_level",
    "register_tis_level",
    "sequence_log_ratio",
    "staleness_histogram",
]

def _as_bool_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"response_mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


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


class TISLevel(Protocol):
    def __call__(self, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                 cap: float) -> torch.Tensor:
        """old/behaviour logprobs: [N, T] float; response_mask: [N, T] bool; cap: C, finite and > 0 (checked by
        :func:`importance_weights`). Returns [N, T] float32 weights in [0, C], detached, 0 at masked positions."""
        ...


class MISLevel(Protocol):
    def __call__(self, log_ratio: torch.Tensor, known: torch.Tensor, response_mask: torch.Tensor, log_low: float,
                 log_high: float) -> torch.Tensor:
        """log_ratio, known: [N, T] (:func:`importance_log_ratio`); response_mask: [N, T] bool; log_low < log_high:
        the band's natural logs. Returns [N, T] bool, the tokens kept (intersected with response_mask after)."""
        ...


#: TIS levels by name (``algorithm.tis_level``): how the truncated ratio weights are formed.
TIS_LEVELS: Registry[TISLevel] = Registry("TIS level")
#: MIS levels by name (``algorithm.mis.level``): which tokens the band drops.
MIS_LEVELS: Registry[MISLevel] = Registry("MIS level")


def register_tis_level(name: str):
    """Decorator adding a TIS weight function (:class:`TISLevel`) to `TIS_LEVELS`; a duplicate name raises
    `ValueError`."""
    return TIS_LEVELS.register(name)


def register_mis_level(name: str):
    """Decorator adding an MIS keep-mask function (:class:`MISLevel`) to `MIS_LEVELS`; a duplicate name raises
    `ValueError`."""
    return MIS_LEVELS.register(name)


@register_tis_level("token")
def _tis_token(old_logprobs, behaviour_logprobs, response_mask, cap):
    """w_t = min(ρ_t, C) (``grpo.losses.truncated_importance_weights``)."""
    return truncated_importance_weights(old_logprobs, behaviour_logprobs, response_mask, cap)


@register_tis_level("sequence")
def _tis_sequence(old_logprobs, behaviour_logprobs, response_mask, cap):
    """w_t = min(exp(clamp(Σ_s log ρ_s, −20, 20)), C) for every token t of the sequence."""
    log_ratio, _ = importance_log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    seq = sequence_log_ratio(log_ratio, response_mask, "sum").clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weights = torch.exp(seq).clamp(max=cap).unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask, weights, torch.zeros((), dtype=torch.float32, device=weights.device))


@register_mis_level("token")
def _mis_token(log_ratio, known, response_mask, log_low, log_high):
    """Keep t ⇔ low ≤ ρ_t ≤ high, or t has no finite behaviour logprob (no correction)."""
    inside = (log_ratio >= log_low) & (log_ratio <= log_high)
    return response_mask & (inside | ~known)


@register_mis_level("sequence")
def _mis_sequence(log_ratio, known, response_mask, log_low, log_high):
    """Keep every token of sequence i ⇔ low ≤ exp(mean_t log ρ_t) ≤ high (geometric-mean ratio)."""
    seq = sequence_log_ratio(log_ratio, response_mask, "mean")
    inside = (seq >= log_low) & (seq <= log_high)
    return response_mask & inside.unsqueeze(-1)


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       cap: float, level: str = "token") -> torch.Tensor:
    """Truncated importance-sampling (TIS) weights multiplying the pg term (Yao et al. 2025; module doc), formed by
    the level registered in :data:`TIS_LEVELS` under ``level``. Built in:

        token:     w_t = min(ρ_t, C)                                   (``grpo.losses.truncated_importance_weights``)
        sequence:  w_t = min(exp(clamp(Σ_s log ρ_s, −20, 20)), C) for every token t of the sequence

    Args:
        old_logprobs, behaviour_logprobs: [N, T] float (see :func:`importance_log_ratio`).
        response_mask: [N, T] bool or float (nonzero = valid).
        cap: C, finite and > 0.
        level: a name in :data:`TIS_LEVELS` ("token", "sequence" or a registered one).

    Returns:
        [N, T] float32 in [0, C], detached, finite; 0 at masked positions. A sequence whose every behaviour logprob
        is non-finite has weight min(1, C).

    Raises:
        ValueError: shapes, cap not finite and > 0, unknown level (naming the registered ones).
    """
    weights_of = TIS_LEVELS.lookup(level)
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"cap must be finite and > 0, got {cap!r}")
    if behaviour_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"behaviour_logprobs must have shape {tuple(old_logprobs.shape)} like old_logprobs, "
                         f"got {tuple(behaviour_logprobs.shape)}")
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    return weights_of(old_logprobs, behaviour_logprobs, mask, cap)


def check_mis_band(low: float, high: float) -> None:
    """Raise ``ValueError`` unless 0 < low < high < inf (both finite numbers), naming the bad bound."""
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"MIS band {name} must be a finite number in (0, inf), got {value!r}")
    if not low < high:
        raise ValueError(f"MIS band must have low < high, got low={low!r}, high={high!r}")


def mis_keep_mask(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                  low: float, high: float, level: str = "token") -> torch.Tensor:
    """Masked importance sampling (MIS): which valid tokens stay in the loss (module doc), decided by the level
    registered in :data:`MIS_LEVELS` under ``level``. Built in:

        token:     keep t  ⇔  low ≤ ρ_t ≤ high  (or t has no finite behaviour logprob: no correction)
        sequence:  keep every token of i  ⇔  low ≤ exp(mean_t log ρ_t) ≤ high   (geometric-mean ratio)

    The band is closed. The caller aggregates the loss over the returned mask, so a dropped token leaves both the
    sum and the token/sequence counts (``grpo.losses.aggregate_loss`` with the mask and counts of kept tokens).

    Args:
        old_logprobs, behaviour_logprobs: [N, T] float (see :func:`importance_log_ratio`).
        response_mask: [N, T] bool or float (nonzero = valid).
        low, high: the band, 0 < low < high < inf.
        level: a name in :data:`MIS_LEVELS` ("token", "sequence" or a registered one).

    Returns:
        [N, T] bool, a subset of ``response_mask``.

    Raises:
        ValueError: shapes, a band not inside (0, inf) or low >= high, unknown level (naming the registered ones).
    """
    check_mis_band(low, high)
    keep_of = MIS_LEVELS.lookup(level)
    log_ratio, known = importance_log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    return mask & keep_of(log_ratio, known, mask, math.log(low), math.log(high))


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
