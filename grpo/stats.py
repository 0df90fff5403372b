"""Accuracy estimates for held-out evaluation: pass@1, mean@k, unbiased pass@k, and the Wilson score interval.

Notation: P problems, k samples per problem, c correct samples of one problem. A sample's score is 1.0 (correct) or
0.0 (wrong); scores in [0, 1] are accepted where noted.

- pass@1 (greedy, one sample per problem): the fraction of problems answered correctly.
- mean@k: the mean over problems of the fraction of that problem's k samples that are correct. It equals the unbiased
  pass@1 estimate from k samples (Chen et al. 2021, eq. 1 with k = 1).
- pass@k: the unbiased estimator 1 − C(n − c, k) / C(n, k) of the probability that at least one of k samples is
  correct, from n ≥ k samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models Trained on
  Code", arXiv:2107.03374, eq. 1 and its numerically stable product form in Fig. 3).
- Wilson score interval (E. B. Wilson 1927, "Probable inference, the law of succession, and statistical inference",
  JASA 22:209; recommended over the Wald interval by Agresti & Coull 1998, "Approximate is better than 'exact' for
  interval estimation of binomial proportions", Am. Stat. 52:119), with p̂ = s/n and z the two-sided normal quantile:
      centre = (p̂ + z²/(2n)) / (1 + z²/n)
      half   = z / (1 + z²/n) · sqrt(p̂(1 − p̂)/n + z²/(4n²))
  It stays inside [0, 1] and is not degenerate at s = 0 or s = n.

Pure Python (`statistics.NormalDist` for z); no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from statistics import NormalDist
from typing import NamedTuple

__all__ = ["AccuracyEstimate", "PairedComparison", "accuracy_estimate", "mean_at_k", "paired_comparison",
           "pass_at_1", "pass_at_k", "wilson_interval"]


def _check_confidence(confidence: float) -> None:
    if not isinstance(confidence, Real) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be a number in (0, 1), got {confidence!r}")


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (formula in the module docstring).

    Args:
        successes: correct samples, in [0, n]; a fractional count (e.g. the sum of per-problem fractions, see
            `accuracy_estimate`) is accepted.
        n: samples (trials), an int > 0.
        confidence: two-sided coverage in (0, 1); z = Φ⁻¹(1 − (1 − confidence)/2) (1.959964 at 0.95).

    Returns:
        (low, high), proportions in [0, 1]; low = 0 exactly when successes = 0, high = 1 exactly when successes = n.

    Raises:
        ValueError: n not an int > 0, successes not a number in [0, n], confidence not in (0, 1).
    """
    if isinstance(n, bool) or not isinstance(n, Integral) or n <= 0:
        raise ValueError(f"n must be an int > 0 (the number of samples), got {n!r}")
    if isinstance(successes, bool) or not isinstance(successes, Real) or not 0 <= successes <= n:
        raise ValueError(f"successes must be a number in [0, n={n}], got {successes!r}")
    _check_confidence(confidence)
    n, successes = int(n), float(successes)  # numpy scalars would overflow in their own dtype (4·n² for int8)
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    p = successes / n
    denominator = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return float(low), float(high)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 − C(n − c, k) / C(n, k) (Chen et al. 2021, eq. 1), computed as
    1 − Π_{i = n−c+1}^{n} (1 − k/i) (their Fig. 3), which never forms large binomials.

    Args:
        n: samples drawn for the problem (int ≥ 1); c: correct samples among them (0 ≤ c ≤ n); k: 1 ≤ k ≤ n.

    Raises:
        ValueError: an argument not an int, or out of those ranges.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _scores(values: Sequence[float], what: str) -> list[float]:
    wrong_type = [v for v in values if not isinstance(v, Real)]  # "1" or None would pass or break float()
    if wrong_type:
        raise ValueError(f"{what} must be numbers (1.0 = correct), got {wrong_type[0]!r}")
    out = [float(v) for v in values]
    bad = [v for v in out if not 0.0 <= v <= 1.0]  # also catches NaN
    if bad:
        raise ValueError(f"{what} must be scores in [0, 1] (1.0 = correct), got {bad[0]!r}")
    return out


def pass_at_1(correct: Sequence[float]) -> float:
    """pass@1 with one sample per problem (greedy decoding): the fraction of problems answered correctly.

    Args:
        correct: [P] one score per problem, 1.0/True correct, 0.0/False wrong (values in [0, 1] accepted).

    Raises:
        ValueError: no problems, or a score outside [0, 1], NaN or not a number (a string, None).
    """
    if len(correct) == 0:
        raise ValueError("pass_at_1 needs at least one problem, got none")
    scores = _scores(correct, "pass_at_1 values")
    return sum(scores) / len(scores)


def mean_at_k(per_problem: Sequence[Sequence[float]]) -> float:
    """mean@k: the mean over problems of the fraction of each problem's k samples that are correct.

    Args:
        per_problem: [P][k] scores (1.0 correct, 0.0 wrong; values in [0, 1] accepted), the same k ≥ 1 for every
            problem.

    Raises:
        ValueError: no problems, a problem without samples, problems with different k, a score outside [0, 1]
            or not a number.
    """
    if len(per_problem) == 0:
        raise ValueError("mean_at_k needs at least one problem, got none")
    k = len(per_problem[0])
    for i, samples in enumerate(per_problem):
        if len(samples) != k or k == 0:
            raise ValueError(f"mean_at_k needs the same k >= 1 samples for every problem: problem 0 has {k}, "
                             f"problem {i} has {len(samples)}")
    return sum(sum(_scores(s, f"problem {i}'s samples")) / k for i, s in enumerate(per_problem)) / len(per_problem)


class AccuracyEstimate(NamedTuple):
    """A held-out accuracy with its interval, as the ``eval/*`` metrics report it."""

    accuracy: float  #: pass@1 (k = 1) or mean@k, a proportion in [0, 1]
    ci_low: float  #: Wilson lower bound
    ci_high: float  #: Wilson upper bound
    problems: int  #: P, problems scored
    samples: int  #: P · k, completions scored


def accuracy_estimate(per_problem: Sequence[Sequence[float]], confidence: float = 0.95) -> AccuracyEstimate:
    """mean@k (pass@1 when k = 1) with a Wilson interval over the P problems.

    The interval treats each problem's fraction correct as one trial with that fractional success (successes =
    P · mean@k, n = P). A score in [0, 1] with mean μ has variance ≤ μ(1 − μ), the Bernoulli variance, so for
    k > 1 this is conservative (at least as wide as needed); for k = 1 it is the exact Wilson interval. Treating the
    P · k samples as independent trials would be too narrow: samples of one problem are correlated.

    Problems may have different numbers of samples k_j ≥ 1 (held-out evaluation passes only the scored samples of
    each problem, and only problems with one): the accuracy is then the mean over problems of each one's fraction
    correct, equal to `mean_at_k` when every k_j is the same, and ``samples`` is Σ_j k_j.

    Args:
        per_problem: [P][k_j] scores (1.0 correct, 0.0 wrong; values in [0, 1] accepted). confidence: in (0, 1).

    Raises:
        ValueError: no problems, a problem without samples, a score outside [0, 1] or not a number, and as
            `wilson_interval`.
    """
    if len(per_problem) == 0:
        raise ValueError("accuracy_estimate needs at least one problem, got none")
    empty = [i for i, samples in enumerate(per_problem) if len(samples) == 0]
    if empty:
        raise ValueError(f"accuracy_estimate needs at least one sample per problem: problem {empty[0]} has none")
    fractions = [sum(_scores(s, f"problem {i}'s samples")) / len(s) for i, s in enumerate(per_problem)]
    problems = len(per_problem)
    accuracy = sum(fractions) / problems
    low, high = wilson_interval(min(accuracy * problems, problems), problems, confidence)
    return AccuracyEstimate(accuracy, low, high, problems, sum(len(s) for s in per_problem))


class PairedComparison(NamedTuple):
    """Two models' 0/1 outcomes on the same problems. ``gained``: wrong before, right after; ``lost``: right before,
    wrong after; ``p_value``: McNemar's exact two-sided test that gains and losses are equally likely."""

    n: int
    before: int
    after: int
    gained: int
    lost: int
    p_value: float


def paired_comparison(before: Sequence[float], after: Sequence[float]) -> PairedComparison:
    """Compare two models on the same problems, problem by problem (McNemar's exact test).

    Only the discordant problems carry information about a difference: under "no change" each of the
    ``gained + lost`` of them is a gain with probability 1/2, so the two-sided p-value is
    ``min(1, 2 · P[Binomial(gained + lost, 1/2) ≤ min(gained, lost)])`` (McNemar 1947; the exact form, e.g.
    Agresti, *Categorical Data Analysis*, 3rd ed., §11.1). With few correct answers (a 135M model on GSM8K) this is
    far sharper than comparing two Wilson intervals, which ignore that the problems are the same.

    Args:
        before, after: per-problem scores in {0, 1} (floats or ints), same length and problem order.

    Raises:
        ValueError: different lengths, no problems, or a score other than 0 or 1 (a string or None included).
    """
    if len(before) != len(after) or len(before) == 0:  # len(), not truthiness: numpy arrays are accepted
        raise ValueError(f"expected two equally long, non-empty score lists, got {len(before)} and {len(after)}")
    a, b = _scores(before, "before"), _scores(after, "after")
    if any(v not in (0.0, 1.0) for v in a + b):
        raise ValueError("paired_comparison needs 0/1 scores (one sample per problem)")
    gained = sum(1 for x, y in zip(a, b) if x == 0.0 and y == 1.0)
    lost = sum(1 for x, y in zip(a, b) if x == 1.0 and y == 0.0)
    m = gained + lost
    # Exact integers, each C(m, i + 1) from C(m, i): O(m) products, where a math.comb per term was O(m²) and took
    # 45 s at 20 000 discordant problems. The one division of two integers is correctly rounded, so no overflow.
    term = total = 1
    for i in range(min(gained, lost)):
        term = term * (m - i) // (i + 1)
        total += term
    tail = total / 2**m
    return PairedComparison(n=len(a), before=int(sum(a)), after=int(sum(b)), gained=gained, lost=lost,
                            p_value=min(1.0, 2 * tail))
