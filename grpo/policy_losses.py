"""Policy-gradient terms selectable by ``algorithm.policy_loss``: the token-level PPO clipped surrogate, the
sequence-level GSPO and GSPO-token objectives, and CISPO's clipped, stop-gradient importance weight.

Shapes:
    N   sequences in the micro-batch, T response tokens (padded)

Each term maps the current policy's logprobs (with autograd), the proximal ("old") logprobs and the advantages to a
per-token loss pg [N, T], which :func:`grpo.losses.policy_loss` then re-weights (truncated IS), adds the KL penalty and
entropy bonus to, and aggregates (``algorithm.loss_agg``). With r_t = exp(clamp(logp_t − old_t, −20, 20)) and
A the advantage:

    ppo         pg_t = −min(r_t·A_t, clip(r_t, 1 − ε_low, 1 + ε_high)·A_t)
                PPO (Schulman et al. 2017) with DAPO's asymmetric clip-higher bounds (Yu et al. 2025).
    gspo        s_i = exp(clamp(mean_{t ∈ i} (logp_t − old_t), −20, 20)), the geometric mean of the token ratios;
                ℓ_i = −min(s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i), clipped per sequence, and pg_t = ℓ_i at
                every valid token of sequence i. GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization"
                (arXiv:2507.18071), eq. 5-7. Needs one advantage per sequence.
    gspo_token  s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)] (value s_i, gradient s_i·∇ log π_θ(y_t));
                pg_t = −min(s_{i,t}·A_{i,t}, clip(s_{i,t}, 1 − ε_low, 1 + ε_high)·A_{i,t}). GSPO-token, the same
                paper, eq. 13-14: per-token advantages allowed (``kl_in_reward``); with one advantage per sequence it
                equals gspo in value and gradient, under every aggregation (each token's gradient is s_i·A_i·∇logp_t,
                whose sum over the sequence is |y_i|·A_i·∇s_i, the broadcast ℓ_i's), unless per-token weights
                (token-level TIS) vary within a sequence: gspo then spreads the sequence's summed weight evenly over
                its tokens' gradients, gspo_token weighs each token's own gradient.
    cispo       w_t = sg[clip(r_t, 1 − ε_low, 1 + ε_high)];  pg_t = −w_t·A_t·logp_t. CISPO, MiniMax 2025,
                "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (arXiv:2506.13585),
                eq. 4: the importance weight is clipped and detached, so no token's gradient is dropped (PPO's clip
                zeroes it); ε_low near 1 leaves the weight without a lower bound, as the paper does.

At the first iteration of a step (current = proximal policy) r = s = 1 and every term's gradient is −A·∇logp per
token (gspo: per sequence, −A_i·∇ mean_t logp_t): the variants differ from the second iteration on, or when the
proximal policy is not the current one.

Dual clip (``dual_clip_c``, Ye et al. 2020): ppo and gspo_token per token, gspo per sequence, bound a negative
advantage's loss by c·|A|; cispo refuses it (its loss −w·A·logp is no ratio·A surrogate, and its weight is bounded
already).

Composition with the aggregations: every term is a per-token loss (gspo's ℓ_i at each token of sequence i), so
every ``algorithm.loss_agg`` applies: ``seq-mean-token-mean`` gives GSPO's 1/G Σ_i ℓ_i; ``token-mean`` weighs each
sequence by its length (TRL's GSPO with ``loss_type="dapo"``); ``seq-mean-token-sum-norm`` by length / cap. The KL
penalty and the entropy bonus add to any term per token; truncated IS weights multiply it per token; with
``algorithm.mis`` the mask is the kept tokens, so gspo's s_i is the geometric mean over a sequence's kept tokens.

The terms are named registries' entries (:data:`POLICY_LOSSES`); ``@register_policy_loss("name")`` adds one, with
``sequence_advantages=True`` when it needs one advantage per sequence and ``dual_clip=False`` when it refuses a dual
clip (the spec checks both at validation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from grpo.registry import Registry, set_implied

__all__ = ["GSPO_CLIP", "LOG_RATIO_CLAMP", "POLICY_LOSSES", "PolicyLossName", "PolicyTerm", "register_policy_loss",
           "sequence_advantages", "supports_dual_clip"]

#: The built-in names (a type for callers; the registry owns the selectable names).
PolicyLossName = Literal["ppo", "gspo", "gspo_token", "cispo"]

#: The log importance ratio (token, or a sequence's mean) is clamped to ±LOG_RATIO_CLAMP before exp.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyTerm:
    """A policy loss term of one micro-batch.

    Attributes:
        pg: [N, T] float32 per-token loss with autograd; exactly 0 at masked positions.
        ratio: [N, T] float32, detached: the importance ratio the term uses (gspo: s_i at each token of i).
        clipped: [N, T] bool, valid tokens where the clip was active (gspo: every token of a clipped sequence;
            cispo: tokens whose weight was truncated).
        dual_active: [N, T] bool, valid tokens where the dual-clip bound was active; None without a dual clip.
    """

    pg: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_active: torch.Tensor | None = None


class PolicyLossTerm(Protocol):
    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, clip_eps_low: float, clip_eps_high: float,
                 dual_clip_c: float | None) -> PolicyTerm:
        """logprobs: [N, T] float32 with autograd; old_logprobs, advantages: [N, T] float32, detached; all three 0
        at masked positions; mask: [N, T] bool. Bounds are checked by the caller (``grpo.losses.policy_loss``)."""
        ...


#: Policy loss terms by name (``algorithm.policy_loss``).
POLICY_LOSSES: Registry[PolicyLossTerm] = Registry("policy loss")


def register_policy_loss(name: str, *, sequence_advantages: bool = False, dual_clip: bool = True,
                         implies: Mapping[str, float] | None = None,
                         why: str = "") -> Callable[[PolicyLossTerm], PolicyLossTerm]:
    """Decorator adding a term to :data:`POLICY_LOSSES`; a duplicate name raises ``ValueError``.

    Args:
        sequence_advantages: the term needs one advantage per sequence (refused with ``kl_in_reward``'s per-token
            advantages). dual_clip: the term honours ``dual_clip_c`` (else it is refused with one).
        implies: settings of the spec's ``algorithm`` section that choosing the term implies unless the spec sets
            them (its source's clip range: ``{"clip_eps_low": ..., "clip_eps_high": ...}``), with ``why`` (the
            source; :func:`grpo.registry.set_implied`).
    """

    def decorator(fn: PolicyLossTerm) -> PolicyLossTerm:
        fn.sequence_advantages = sequence_advantages  # type: ignore[attr-defined]
        fn.dual_clip = dual_clip  # type: ignore[attr-defined]
        return POLICY_LOSSES.register(name)(set_implied(fn, implies, why))

    return decorator


def sequence_advantages(name: str) -> bool:
    """Whether the registered policy loss ``name`` needs one advantage per sequence (``ValueError`` if unknown)."""
    return bool(getattr(POLICY_LOSSES.lookup(name), "sequence_advantages", False))


def supports_dual_clip(name: str) -> bool:
    """Whether the registered policy loss ``name`` honours ``dual_clip_c`` (``ValueError`` if unknown)."""
    return bool(getattr(POLICY_LOSSES.lookup(name), "dual_clip", True))


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps_low: float,
                       clip_eps_high: float, dual_clip_c: float | None) -> PolicyTerm:
    """−min(ratio·A, clip(ratio)·A), then the dual-clip bound; ratio, adv: same shape ([N, T] or [N]), mask alike."""
    surr_unclipped = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    pg = -torch.minimum(surr_unclipped, surr_clipped)
    clipped = mask & (surr_clipped < surr_unclipped)
    dual_active = None
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual_active = mask & (adv < 0) & (bound < pg)
        pg = torch.where(dual_active, bound, pg)
    return PolicyTerm(pg=pg, ratio=ratio.detach(), clipped=clipped, dual_active=dual_active)


def _sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] mean over each sequence's valid tokens of logp − old, clamped to ±LOG_RATIO_CLAMP (0 for an empty row);
    carries the gradient of ``logprobs``."""
    count = mask.sum(dim=-1).to(torch.float32).clamp(min=1.0)
    return ((logprobs - old_logprobs).sum(dim=-1) / count).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _per_sequence(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] the advantage of each sequence from [N, T] advantages constant over its valid tokens.

    Raises:
        ValueError: a sequence's advantages differ between its tokens (per-token advantages, ``kl_in_reward``).
    """
    first = mask.to(torch.float32).argmax(dim=-1, keepdim=True)
    per_seq = advantages.gather(-1, first)
    varying = mask & (advantages != per_seq)
    if bool(varying.any()):
        row = int(varying.any(dim=-1).nonzero()[0])
        raise ValueError(f"policy_loss 'gspo' needs one advantage per sequence, got per-token advantages (sequence "
                         f"{row} varies; algorithm.kl_in_reward makes them per token): use policy_loss 'gspo_token'")
    return per_seq.squeeze(-1)


@register_policy_loss("ppo")
def _ppo(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
    """PPO's clipped surrogate per token (module doc)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clipped_surrogate(ratio, advantages, mask, clip_eps_low, clip_eps_high, dual_clip_c)


#: GSPO's clip range for its sequence-level ratio: "we set the left and right clipping ranges in Eq. (5) to 3e-4 and
#: 4e-4" (Zheng et al. 2025, sec. 5.1), about 500x narrower than PPO's token-level 0.2 (a geometric mean of token
#: ratios moves far less than one token's).
GSPO_CLIP = {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}
_GSPO_WHY = "GSPO's clip range of its sequence-level ratio (Zheng et al. 2025, sec. 5.1)"


@register_policy_loss("gspo", sequence_advantages=True, implies=GSPO_CLIP, why=_GSPO_WHY)
def _gspo(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
    """GSPO: the sequence's geometric-mean ratio clipped per sequence, its loss at each of its tokens (module doc)."""
    valid = mask.any(dim=-1)
    s = torch.exp(_sequence_log_ratio(logprobs, old_logprobs, mask))
    seq = _clipped_surrogate(s, _per_sequence(advantages, mask), valid, clip_eps_low, clip_eps_high, dual_clip_c)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1).expand(mask.shape) & mask if x.dtype == torch.bool else \
            torch.where(mask, x.unsqueeze(-1).expand(mask.shape), zero)

    return PolicyTerm(pg=tokens(seq.pg), ratio=tokens(seq.ratio), clipped=tokens(seq.clipped),
                      dual_active=None if seq.dual_active is None else tokens(seq.dual_active))


@register_policy_loss("gspo_token", implies=GSPO_CLIP, why=_GSPO_WHY)
def _gspo_token(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
    """GSPO-token: the detached sequence ratio times π_θ(y_t)/sg[π_θ(y_t)], clipped per token (module doc)."""
    log_s = _sequence_log_ratio(logprobs, old_logprobs, mask).detach()
    ratio = torch.exp(logprobs - logprobs.detach() + log_s.unsqueeze(-1))
    return _clipped_surrogate(ratio, advantages, mask, clip_eps_low, clip_eps_high, dual_clip_c)


@register_policy_loss("cispo", dual_clip=False, implies={"clip_eps_low": 0.999}, why=(
    "CISPO puts no lower bound on the IS weight (MiniMax-M1, 2025, sec. 3.1: eps_low set large; 0.999 is the largest "
    "the spec takes); the paper tunes eps_high and gives no value, so the spec's clip_eps_high stays"))
def _cispo(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
    """CISPO: −sg[clip(r)]·A·logp per token (module doc); registered with ``dual_clip=False``, so the caller refuses a
    dual clip."""
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return PolicyTerm(pg=-weight * advantages * logprobs, ratio=ratio, clipped=mask & (weight != ratio))

