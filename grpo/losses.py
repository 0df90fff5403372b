"""The GRPO policy loss (a policy-gradient term, truncated IS weights, KL penalty, entropy bonus) and token/sequence
loss aggregation.

Shapes:
    N   sequences in the micro-batch, T response tokens (padded)

Per token (masked positions excluded everywhere with `torch.where`, so NaN/Inf in padding never reaches the loss
or its gradient):
    pg = the policy-gradient term named by ``loss_mode`` (``algorithm.policy_loss``; `grpo.policy_losses`):
        ppo (default): −min(ratio·A, clip(ratio, 1 − clip_eps_low, 1 + clip_eps_high)·A),
            ratio = exp(clamp(logp − old_logp, −20, 20)), PPO clipped surrogate (Schulman et al. 2017, "Proximal
            Policy Optimization Algorithms"); asymmetric "clip-higher" bounds from DAPO (Yu et al. 2025);
        gspo / gspo_token: the sequence-level ratio (GSPO, Zheng et al. 2025); cispo: the clipped, stop-gradient
            importance weight times the logprob (MiniMax-M1, 2025); formulas in `grpo.policy_losses`.
    dual clip, A < 0 only:  pg = min(pg, dual_clip_c·|A|)   (Ye et al. 2020, "Mastering Complex Control in MOBA
        Games with Deep Reinforcement Learning"), bounding the loss of a token whose ratio has exploded.
    pg ← pg · tis_weights (truncated importance-sampling weights, detached; truncation is the caller's job)
    total = pg + kl_coef·kl_penalty(logp, ref_logp) − entropy_coef·entropy

Aggregation and global counts: `num_tokens` / `num_sequences` are counts over the whole mini-batch (all
micro-batches on all data-parallel ranks). Every aggregation is a sum of per-token or per-sequence terms divided by
such a count, so with global counts the losses of the micro-batches and ranks *add up* to the full mini-batch loss:
accumulate gradients of the returned loss without further scaling (and sum, not average, across data-parallel ranks;
FSDP averages gradients, so multiply the loss by the world size or use a sum reduction there). Without them, the
counts default to the local micro-batch and the loss is the local mean.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Literal, Protocol

import torch

from grpo.kl import KLEstimatorName, kl_penalty
from grpo import policy_losses
from grpo.policy_losses import LOG_RATIO_CLAMP, supports_dual_clip
from grpo.registry import Registry

LossAggregationName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Count = int | torch.Tensor

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "LossAggregationName",
    "aggregate_loss",
    "policy_loss",
    "register_loss_aggregation",
    "truncated_importance_weights",
]


class LossAggregation(Protocol):
    def __call__(
        self,
        masked_loss: torch.Tensor,
        mask: torch.Tensor,
        *,
        num_tokens: Count | None,
        num_sequences: Count | None,
        max_response_tokens: int | None,
    ) -> torch.Tensor:
        """masked_loss: [N, T] float32, exactly 0 where mask is False; mask: [N, T] bool. Returns a 0-d tensor."""
        ...


LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation")


def register_loss_aggregation(name: str):
    """Decorator adding an aggregation to `LOSS_AGGREGATIONS`; a duplicate name raises `ValueError`."""
    return LOSS_AGGREGATIONS.register(name)


def _denominator(name: str, given: Count | None, local: torch.Tensor) -> torch.Tensor:
    """The count to divide by: `given` (global) if set, else `local`; at least 1 so an empty batch gives 0, not NaN."""
    if given is None:
        return local.to(torch.float32).clamp(min=1.0)
    if isinstance(given, torch.Tensor):
        if given.numel() != 1:
            raise ValueError(f"{name} must be an int or a 1-element tensor, got shape {tuple(given.shape)}")
        return given.reshape(()).to(device=local.device, dtype=torch.float32).clamp(min=1.0)
    if isinstance(given, bool) or not isinstance(given, Real) or given < 0 or given != int(given):
        raise ValueError(f"{name} must be a non-negative integer count, got {given!r}")
    return torch.tensor(float(max(int(given), 1)), device=local.device)


def _num_valid_sequences(mask: torch.Tensor) -> torch.Tensor:
    return mask.any(dim=-1).sum()


@register_loss_aggregation("token-mean")
def _token_mean(masked_loss, mask, *, num_tokens, num_sequences, max_response_tokens):
    """Σ_valid loss / num_tokens (default: valid tokens in this batch). Long sequences weigh more (DAPO)."""
    return masked_loss.sum() / _denominator("num_tokens", num_tokens, mask.sum())


@register_loss_aggregation("seq-mean-token-mean")
def _seq_mean_token_mean(masked_loss, mask, *, num_tokens, num_sequences, max_response_tokens):
    """Σ_seq (mean of the sequence's valid tokens) / num_sequences (default: sequences with ≥ 1 valid token).

    Source: the original GRPO objective (Shao et al. 2024), 1/G Σ_i 1/|o_i| Σ_t.
    """
    per_seq = masked_loss.sum(dim=-1) / mask.sum(dim=-1).to(torch.float32).clamp(min=1.0)
    return per_seq.sum() / _denominator("num_sequences", num_sequences, _num_valid_sequences(mask))


@register_loss_aggregation("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(masked_loss, mask, *, num_tokens, num_sequences, max_response_tokens):
    """Σ_valid loss / (num_sequences · max_response_tokens): a constant normaliser with no length bias.

    Source: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training"). num_sequences defaults to the
    sequences with ≥ 1 valid token in this batch.
    """
    if max_response_tokens is None:
        raise ValueError("loss_agg 'seq-mean-token-sum-norm' requires max_response_tokens (got None)")
    if isinstance(max_response_tokens, bool) or not isinstance(max_response_tokens, int) or max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be an int >= 1, got {max_response_tokens!r}")
    denom = _denominator("num_sequences", num_sequences, _num_valid_sequences(mask)) * float(max_response_tokens)
    return masked_loss.sum() / denom


def _as_bool_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"response_mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: LossAggregationName,
    *,
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    max_response_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with the named aggregation.

    Args:
        per_token_loss: [N, T] float; values where `mask` is 0 are ignored (even NaN/Inf), in value and gradient.
        mask: [N, T] bool or float (nonzero = valid token).
        loss_agg: a name in `LOSS_AGGREGATIONS`: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm".
        num_tokens: global count of valid tokens in the mini-batch (int or 1-element tensor); default: local.
        num_sequences: global count of sequences with ≥ 1 valid token in the mini-batch; default: local.
        max_response_tokens: the response-length cap; required by "seq-mean-token-sum-norm".

    Returns:
        0-d float32 tensor. With global counts, summing it over micro-batches and ranks gives the mini-batch loss.
        An all-masked batch gives 0.

    Raises:
        ValueError: shapes, unknown name, negative counts, missing max_response_tokens.
    """
    fn = LOSS_AGGREGATIONS.lookup(loss_agg)
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss must be [N, T], got shape {tuple(per_token_loss.shape)}")
    mask = _as_bool_mask(mask, per_token_loss.shape)
    masked = torch.where(mask, per_token_loss.to(torch.float32), torch.zeros((), device=per_token_loss.device))
    return fn(
        masked, mask, num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=max_response_tokens
    )


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return (total / mask.sum().to(x.dtype).clamp(min=1.0)).detach()


def _check_same_shape(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if x is not None and x.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} like logprobs, got {tuple(x.shape)}")


def _check_coefs(clip_eps_low, clip_eps_high, dual_clip_c, kl_coef, entropy_coef, ref_logprobs, entropy) -> None:
    if not 0.0 <= clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {clip_eps_low!r}")
    if not (math.isfinite(clip_eps_high) and clip_eps_high >= 0.0):
        raise ValueError(f"clip_eps_high must be finite and >= 0, got {clip_eps_high!r}")
    if dual_clip_c is not None and not (math.isfinite(dual_clip_c) and dual_clip_c > 1.0):
        raise ValueError(f"dual_clip_c must be None or finite and > 1, got {dual_clip_c!r}")
    if not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef must be finite, got {kl_coef!r}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (got None)")
    if not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef must be finite, got {entropy_coef!r}")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy (got None)")


def _broadcast_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if advantages.shape == shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.unsqueeze(-1).expand(shape)
    raise ValueError(
        f"advantages must have shape [N]=({shape[0]},) or [N, T]={tuple(shape)}, got {tuple(advantages.shape)}"
    )


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance-sampling (TIS) weights correcting the engine/trainer mismatch, per token.

        w_t = min(π_old_trainer(y_t) / π_engine(y_t), C) = min(exp(clamp(old − engine, −20, 20)), C)

    The rollout engine's numerics (kernels, precision) differ from the trainer's, so tokens are sampled from
    π_engine while the loss assumes π_old_trainer; weighting each token's policy-gradient term by the ratio,
    truncated at C to bound the variance, corrects the bias. Source: Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training" (truncated IS after Espeholt et al. 2018, IMPALA).

    Args:
        old_logprobs: [N, T] float32, the trainer's logprobs of the sampled tokens before the update.
        behaviour_logprobs: [N, T] float32, the engine's logprobs of the same tokens. A non-finite value (NaN or
            ±inf, e.g. from a faulty engine kernel) gives that token weight 1 (min(1, C) if C < 1): the token is
            trained as without TIS instead of poisoning the loss; the driver counts such tokens
            (``rollout/nonfinite_logprobs``).
        response_mask: [N, T] bool or float (nonzero = valid); masked positions (any value) give 0.
        cap: C > 0.

    Returns:
        [N, T] float32 weights in [0, C], detached, always finite.

    Raises:
        ValueError: shapes or cap not finite and > 0.
    """
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"cap must be finite and > 0, got {cap!r}")
    _check_same_shape("behaviour_logprobs", behaviour_logprobs, old_logprobs.shape)
    mask = _as_bool_mask(response_mask, old_logprobs.shape)
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs.device)
    behaviour = behaviour_logprobs.detach().float()
    known = torch.isfinite(behaviour)  # a NaN/±inf engine logprob gives no ratio: weight 1, no correction
    diff = torch.where(mask & known, old_logprobs.detach().float() - behaviour, zero)
    weights = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
    return torch.where(mask, weights, zero)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
    loss_agg: LossAggregationName = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimatorName = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    max_response_tokens: int | None = None,
    tis_weights: torch.Tensor | None = None,
    loss_mode: str = "ppo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss: the ``loss_mode`` policy-gradient term with optional KL penalty, entropy bonus, dual clip and
    truncated IS weights (formulas: module doc).

    Args:
        logprobs: [N, T] float32, natural-log probs of the response tokens under the current policy (grad flows).
        old_logprobs: [N, T] float32, behaviour (old) policy logprobs; detached.
        advantages: [N] (broadcast over T) or [N, T] float32; detached.
        response_mask: [N, T] bool or float (nonzero = valid response token). Any value (NaN/Inf included) of any
            input at a masked position is ignored in the loss, its gradient and the metrics.
        clip_eps_low: ε_low in [0, 1); lower ratio bound 1 − ε_low.
        clip_eps_high: ε_high ≥ 0; upper ratio bound 1 + ε_high (DAPO clip-higher when > ε_low).
        dual_clip_c: None, or c > 1: for A < 0 the token loss is at most c·|A| (Ye et al. 2020).
        loss_agg: a name in `LOSS_AGGREGATIONS` (see `aggregate_loss`).
        ref_logprobs: [N, T] float32 reference-policy logprobs (detached), required if kl_coef ≠ 0.
        kl_coef: β, weight of the per-token KL penalty in the loss (for KL in the reward instead, pass 0 here and
            per-token advantages from `grpo.kl.kl_reward_advantages`).
        kl_estimator: "k1", "k2" or "k3" (`grpo.kl`).
        entropy: [N, T] float32 per-token policy entropy; NOT detached, so the bonus trains the policy when it
            carries gradient from the logits. Required if entropy_coef ≠ 0.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        num_tokens, num_sequences: GLOBAL mini-batch counts (see module doc); default: local counts.
        max_response_tokens: required by "seq-mean-token-sum-norm".
        tis_weights: [N, T] float32 truncated importance weights multiplying the pg term; detached
            (`truncated_importance_weights`).
        loss_mode: a name in `grpo.policy_losses.POLICY_LOSSES` (``algorithm.policy_loss``): "ppo", "gspo",
            "gspo_token", "cispo" or a registered one.

    Returns:
        loss: 0-d float32, aggregated with the global counts (micro-batch and rank losses add up).
        metrics: detached 0-d float32 tensors (no device sync; call `.item()` when logging):
            pg_loss          pg term aggregated like the loss (global normalisation, so it adds up too)
            clip_fraction    fraction of valid tokens where the clip was active (gspo: tokens of clipped
                             sequences; cispo: tokens whose weight was truncated)
            dual_clip_fraction  fraction of valid tokens where the dual-clip bound was active (if dual_clip_c)
            ratio_mean       masked mean of the importance ratio (gspo: of each token's sequence ratio)
            kl               masked mean of the KL estimate (only if ref_logprobs is given)
            entropy          masked mean entropy (only if entropy is given)
            num_tokens_local, num_sequences_local   valid tokens / sequences with ≥ 1 valid token here
        All metrics except pg_loss are means over this micro-batch's valid tokens only (counted locally, not
        globally normalised); weight them by num_tokens_local to combine micro-batches and ranks.

    Raises:
        ValueError: shapes, out-of-range coefficients, kl_coef ≠ 0 without ref_logprobs, entropy_coef ≠ 0
            without entropy, an unknown ``loss_mode``, a ``dual_clip_c`` with a loss mode that refuses it (cispo),
            per-token advantages with one that needs them per sequence (gspo), plus the errors of `aggregate_loss`.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("entropy", entropy),
                    ("tis_weights", tis_weights)):
        _check_same_shape(name, x, shape)
    _check_coefs(clip_eps_low, clip_eps_high, dual_clip_c, kl_coef, entropy_coef, ref_logprobs, entropy)
    if dual_clip_c is not None and not supports_dual_clip(loss_mode):
        raise ValueError(f"policy loss {loss_mode!r} takes no dual_clip_c (got {dual_clip_c!r}; "
                         f"algorithm.dual_clip_c must be null with algorithm.policy_loss {loss_mode!r})")
    mask = _as_bool_mask(response_mask, shape)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)

    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.to(torch.float32), zero)

    logp = clean(logprobs)
    adv = clean(_broadcast_advantages(advantages.detach(), shape))
    term_of = policy_losses.POLICY_LOSSES.lookup(loss_mode)
    term = term_of(logp, clean(old_logprobs.detach()), adv, mask, clip_eps_low=clip_eps_low,
                   clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)
    pg = term.pg
    metrics: dict[str, torch.Tensor] = {}
    if term.dual_active is not None:
        metrics["dual_clip_fraction"] = _masked_mean(term.dual_active.to(torch.float32), mask)
    if tis_weights is not None:
        pg = pg * clean(tis_weights.detach())

    total = pg
    if ref_logprobs is not None:
        kl = kl_penalty(logp, clean(ref_logprobs.detach()), kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask)
        if kl_coef != 0.0:
            total = total + kl_coef * kl
    if entropy is not None:
        ent = clean(entropy)
        metrics["entropy"] = _masked_mean(ent, mask)
        if entropy_coef != 0.0:
            total = total - entropy_coef * ent

    counts = dict(num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=max_response_tokens)
    loss = aggregate_loss(total, mask, loss_agg, **counts)
    metrics["pg_loss"] = aggregate_loss(pg.detach(), mask, loss_agg, **counts)
    metrics["clip_fraction"] = _masked_mean(term.clipped.to(torch.float32), mask)
    metrics["ratio_mean"] = _masked_mean(term.ratio, mask)
    metrics["num_tokens_local"] = mask.sum().to(torch.float32)
    metrics["num_sequences_local"] = _num_valid_sequences(mask).to(torch.float32)
    return loss, metrics
