"""The GRPO step's metric sums and the metrics made from them (:class:`train_workers.grpo_step.GRPOStep`).

Each micro-batch adds its token-weighted sums to a float64 vector laid out as :data:`SUMS`; the step all-reduces the
vector of every iteration over the ranks (every sequence counted once) and turns the totals into the ``actor/*``,
``rollout/logprob_diff``, ``perf/*``, ``timing/*`` and ``memory/*`` metrics (:func:`step_metrics`) and, with an
off-policy correction on, the correction's metrics (:func:`off_policy_metrics`, with the MAX-reduced ratio extremes
laid out as :data:`EXTREMES`).
"""

from __future__ import annotations

import math
import time

import torch

#: Layout of the per-micro-batch metric sums that the step all-reduces (token-weighted sums unless noted).
SUMS = {name: i for i, name in enumerate((
    "loss",            # aggregated loss (already globally normalised: sums to the batch loss)
    "kl", "clip", "entropy", "ratio", "dual_clip", "tis",
    "tokens",          # loss tokens (the weights of the sums above)
    "logprob_diff",    # Σ |trainer old logprob − engine logprob|, first iteration only
    "tokens_first",    # loss tokens of the first iteration with a finite engine logprob (logprob_diff's and
                       # kl_behaviour's denominator: a token whose engine logprob is NaN/inf is in neither sum)
    "forward_tokens",  # packed tokens run forward (all passes)
    "nonfinite_loss",       # ranks whose local loss sum is NaN/Inf (0/1 per rank, so the reduced sum counts ranks)
    "nonfinite_grad_norm",  # ranks that saw a NaN/Inf global gradient norm
    # off-policy correction (tis_cap or mis set), first iteration only:
    "mis_masked",           # valid loss tokens that MIS dropped
    "tokens_valid_first",   # valid loss tokens before MIS
    "kl_behaviour",         # Σ k3 estimate of KL(behaviour || proximal) over tokens with a finite engine logprob
))}

#: Layout of the off-policy extremes that the step all-reduces with MAX (log space; -inf: no token).
EXTREMES = {name: i for i, name in enumerate((
    "log_ratio_max", "neg_log_ratio_min",          # token ratio proximal / behaviour
    "seq_log_ratio_max", "neg_seq_log_ratio_min",  # geometric-mean ratio of each sequence
))}

#: Metric names reported as the cause of a skipped update, in the order they are checked.
NONFINITE = {"nonfinite_loss": "actor/loss", "nonfinite_grad_norm": "actor/grad_norm"}

#: A rank's wall seconds in its train step (the train pool's busy time, ``cluster.loop.goodput``).
COMPUTE_KEY = "timing/train_compute_s"

#: Phases of a train step timed on each rank (``timing/<phase>_s`` in the metrics; rank 0's numbers).
PHASES = ("ref_forward", "behaviour", "policy_fwd_bwd", "optimizer")


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def step_metrics(totals: torch.Tensor, grad_norms: list[float], applied: int, iterations: int, kl_coef: float,
                 lr: float, phase_s: dict[str, float], t0: float) -> dict[str, float]:
    """The step's metrics from the all-reduced sums (layout :data:`SUMS`) of every iteration.

    Args:
        totals: float64 [len(SUMS)], summed over ranks and iterations. grad_norms: each iteration's norm before
            clipping. applied: iterations whose update was applied. kl_coef: β in use. lr: the learning rate in use.
        phase_s: seconds per :data:`PHASES` entry on this rank. t0: ``time.perf_counter()`` at the step's start.
    """
    n = max(float(totals[SUMS["tokens"]]), 1.0)
    n_first = max(float(totals[SUMS["tokens_first"]]), 1.0)
    return {
        "actor/loss": float(totals[SUMS["loss"]]) / iterations,
        "actor/kl": float(totals[SUMS["kl"]]) / n,
        "actor/kl_coef": kl_coef,
        "actor/clip_fraction": float(totals[SUMS["clip"]]) / n,
        "actor/entropy": float(totals[SUMS["entropy"]]) / n,
        "rollout/logprob_diff": float(totals[SUMS["logprob_diff"]]) / n_first,
        "actor/ratio_mean": float(totals[SUMS["ratio"]]) / n,
        "actor/grad_norm": sum(grad_norms) / iterations,
        "actor/update_skipped": 1.0 - applied / iterations,
        "actor/lr": lr,
        "perf/train_tokens": float(totals[SUMS["forward_tokens"]]),
        COMPUTE_KEY: time.perf_counter() - t0,
        **{f"timing/{name}_s": seconds for name, seconds in phase_s.items()},
        "memory/train_peak_rss_gib": peak_rss_gib(),
    }


def option_metrics(totals: torch.Tensor, algorithm) -> dict[str, float]:
    """The metrics of options that are on: ``actor/dual_clip_fraction`` (``algorithm.dual_clip_c``) and
    ``actor/tis_weight_mean`` (``algorithm.tis_cap``), token means over the loss tokens."""
    n = max(float(totals[SUMS["tokens"]]), 1.0)
    out = {}
    if algorithm.dual_clip_c is not None:
        out["actor/dual_clip_fraction"] = float(totals[SUMS["dual_clip"]]) / n
    if algorithm.tis_cap is not None:
        out["actor/tis_weight_mean"] = float(totals[SUMS["tis"]]) / n
    return out


def off_policy_metrics(totals: torch.Tensor, log_extremes: torch.Tensor, with_mis: bool) -> dict[str, float]:
    """The off-policy correction's metrics from the all-reduced sums of the first iteration and the MAX-reduced
    ratio extremes (float64 [len(EXTREMES)], log space):
    ``actor/kl_behaviour_current`` (mean k3 estimate of KL(engine || trainer before the step) per token with a
    finite engine logprob), ``actor/behaviour_ratio_min/max`` (token ratio trainer/engine),
    ``actor/behaviour_seq_ratio_min/max`` (geometric-mean ratio of a sequence; NaN when there is no token) and,
    ``with_mis``, ``actor/mis_masked_fraction`` (dropped / valid loss tokens)."""
    ext = torch.exp(log_extremes)

    def extreme(name: str, negate: bool) -> float:
        value = float(ext[EXTREMES[name]])
        return math.nan if value == 0.0 else (1.0 / value if negate else value)  # exp(-inf) = 0: no token

    out = {
        "actor/kl_behaviour_current": float(totals[SUMS["kl_behaviour"]]) / max(
            float(totals[SUMS["tokens_first"]]), 1.0),
        "actor/behaviour_ratio_min": extreme("neg_log_ratio_min", True),
        "actor/behaviour_ratio_max": extreme("log_ratio_max", False),
        "actor/behaviour_seq_ratio_min": extreme("neg_seq_log_ratio_min", True),
        "actor/behaviour_seq_ratio_max": extreme("seq_log_ratio_max", False),
    }
    if with_mis:
        out["actor/mis_masked_fraction"] = float(totals[SUMS["mis_masked"]]) / max(
            float(totals[SUMS["tokens_valid_first"]]), 1.0)
    return out
