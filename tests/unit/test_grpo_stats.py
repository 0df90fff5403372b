"""Unit tests for grpo.stats: Wilson interval against independent hand computations and published values, pass@k
against the binomial definition, mean@k / pass@1, and argument errors."""

import math
from itertools import combinations

import pytest

from grpo.stats import accuracy_estimate, mean_at_k, paired_comparison, pass_at_1, pass_at_k, wilson_interval

Z95 = 1.959963984540054  # Φ⁻¹(0.975), from tables


def _wilson_by_quadratic(s: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson bounds as the roots p of (p̂ − p)² = z² p (1 − p) / n (the score test inverted), i.e.
    (1 + z²/n) p² − (2p̂ + z²/n) p + p̂² = 0: a derivation independent of the centre/half-width form."""
    ph = s / n
    a, b, c = 1 + z * z / n, -(2 * ph + z * z / n), ph * ph
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


def test_6_of_200_by_hand():
    # p̂ = 0.03, z² = 3.841459; centre = (0.03 + 3.841459/400) / (1 + 3.841459/200) = 0.0396036 / 1.0192073
    # half = 1.959964 / 1.0192073 · sqrt(0.03·0.97/200 + 3.841459/160000) = 1.923028 · sqrt(1.695091e-4)
    centre = (0.03 + Z95**2 / 400) / (1 + Z95**2 / 200)
    half = Z95 / (1 + Z95**2 / 200) * math.sqrt(0.03 * 0.97 / 200 + Z95**2 / 160000)
    low, high = wilson_interval(6, 200)
    assert low == pytest.approx(centre - half, abs=1e-12)
    assert high == pytest.approx(centre + half, abs=1e-12)
    assert (low, high) == pytest.approx(_wilson_by_quadratic(6, 200, Z95), abs=1e-12)
    assert (low, high) == pytest.approx((0.013820, 0.063894), abs=1e-6)


def test_published_values():
    # 6/32 at 95 %, computed with R's qnorm in a published worked example
    # (https://rstudio-pubs-static.s3.amazonaws.com/1367507_eef7a4d0fb5347a8a820fe3c10141369.html):
    # Wilson (0.08889545, 0.35309155).
    assert wilson_interval(6, 32) == pytest.approx((0.08889545, 0.35309155), abs=5e-9)
    # 81/263 at 95 % (p̂ = 0.308), the example quoted in issue #14's brief: (0.2553, 0.3662) to four places.
    low, high = wilson_interval(81, 263)
    assert round(low, 4) == 0.2553 and round(high, 4) == 0.3662
    assert (low, high) == pytest.approx(_wilson_by_quadratic(81, 263, Z95), abs=1e-12)


@pytest.mark.parametrize(("s", "n", "confidence"), [(1, 7, 0.9), (50, 100, 0.99), (199, 200, 0.95), (3, 200, 0.8)])
def test_matches_quadratic_roots(s, n, confidence):
    z = {0.9: 1.6448536269514722, 0.99: 2.5758293035489004, 0.95: Z95, 0.8: 1.2815515655446004}[confidence]
    assert wilson_interval(s, n, confidence) == pytest.approx(_wilson_by_quadratic(s, n, z), abs=1e-12)


def test_edges_zero_and_all():
    # s = 0: low = 0, high = z²/(n + z²); s = n: the mirror image.
    n = 10
    assert wilson_interval(0, n) == (0.0, pytest.approx(Z95**2 / (n + Z95**2), abs=1e-12))
    assert wilson_interval(n, n) == (pytest.approx(n / (n + Z95**2), abs=1e-12), 1.0)
    assert wilson_interval(0, 1)[0] == 0.0 and wilson_interval(1, 1)[1] == 1.0


def test_interval_contains_estimate_and_narrows_with_n():
    for s, n in [(1, 3), (6, 200), (60, 2000)]:
        low, high = wilson_interval(s, n)
        assert low < s / n < high
    assert wilson_interval(60, 2000)[1] - wilson_interval(60, 2000)[0] < wilson_interval(6, 200)[1] - wilson_interval(
        6, 200)[0]


def test_fractional_successes():
    low, high = wilson_interval(2.5, 10)
    assert (low, high) == pytest.approx(_wilson_by_quadratic(2.5, 10, Z95), abs=1e-12)


@pytest.mark.parametrize(("s", "n", "confidence", "field"), [
    (0, 0, 0.95, "n must be an int > 0"), (0, -3, 0.95, "n must be an int > 0"), (1, 2.0, 0.95, "n must be an int"),
    (-1, 10, 0.95, "successes must be a number in \\[0, n=10\\]"), (11, 10, 0.95, "successes"),
    (float("nan"), 10, 0.95, "successes"), (1, 10, 0.0, "confidence"), (1, 10, 1.0, "confidence"),
    (1, 10, 95, "confidence"),
])
def test_wilson_errors(s, n, confidence, field):
    with pytest.raises(ValueError, match=field):
        wilson_interval(s, n, confidence)


def test_pass_at_k_matches_enumeration():
    # pass@k = P(at least one of k samples drawn without replacement from n is correct), counted over all subsets.
    for n, c, k in [(10, 3, 1), (10, 3, 5), (6, 0, 2), (6, 6, 3), (8, 2, 7), (5, 1, 5)]:
        correct = set(range(c))
        subsets = list(combinations(range(n), k))
        expected = sum(bool(correct & set(sub)) for sub in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (5.0, 2, 1)])
def test_pass_at_k_errors(n, c, k):
    with pytest.raises(ValueError, match="need n >= 1|n must be an int"):
        pass_at_k(n, c, k)


def test_pass_at_1_and_mean_at_k():
    assert pass_at_1([1, 0, 0, True, False]) == pytest.approx(0.4)
    per_problem = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]  # fractions 0.25, 1, 0
    assert mean_at_k(per_problem) == pytest.approx(1.25 / 3)
    # mean@k is the mean over problems of the unbiased pass@1
    assert mean_at_k(per_problem) == pytest.approx(sum(pass_at_k(4, sum(p), 1) for p in per_problem) / 3)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: pass_at_1([]), "at least one problem"), (lambda: pass_at_1([1, 2]), "in \\[0, 1\\]"),
    (lambda: pass_at_1([float("nan")]), "in \\[0, 1\\]"), (lambda: mean_at_k([]), "at least one problem"),
    (lambda: mean_at_k([[1, 0], [1]]), "same k"), (lambda: mean_at_k([[]]), "same k"),
    (lambda: mean_at_k([[1, -0.5]]), "in \\[0, 1\\]"),
])
def test_helper_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_accuracy_estimate():
    greedy = [[1.0]] * 6 + [[0.0]] * 194
    est = accuracy_estimate(greedy)
    assert est.accuracy == pytest.approx(0.03)
    assert (est.ci_low, est.ci_high) == pytest.approx(wilson_interval(6, 200), abs=1e-12)
    assert (est.problems, est.samples) == (200, 200)
    sampled = [[1, 0, 0, 0]] * 4 + [[0, 0, 0, 0]] * 6  # mean@4 = 0.1 over 10 problems, 40 samples
    est = accuracy_estimate(sampled, confidence=0.9)
    assert est.accuracy == pytest.approx(0.1) and (est.problems, est.samples) == (10, 40)
    assert (est.ci_low, est.ci_high) == pytest.approx(_wilson_by_quadratic(1, 10, 1.6448536269514722), abs=1e-12)
    assert accuracy_estimate([[1, 1]] * 5)[1:3] == (pytest.approx(5 / (5 + Z95**2)), 1.0)


def test_wilson_interval_numpy_scalars_match_python_ints():
    """Small numpy integer dtypes would overflow in 4·n² inside their own dtype; the interval must not change."""
    import numpy as np

    expected = wilson_interval(3, 10)
    for got in (wilson_interval(np.int32(3), np.uint8(10)), wilson_interval(np.int8(3), np.int8(10))):
        assert got == pytest.approx(expected, abs=1e-12) and all(type(x) is float for x in got)


# ---- paired comparison (McNemar's exact test) ------------------------------------------------------------------------
def test_paired_comparison_by_hand():
    # 4 lost, 2 gained, 1 right in both, 1 wrong in both: m = 6 discordant; P[X <= 2] = (1 + 6 + 15) / 64.
    before = [1, 1, 1, 1, 0, 0, 1, 0]
    after = [0, 0, 0, 0, 1, 1, 1, 0]
    got = paired_comparison(before, after)
    assert (got.n, got.before, got.after, got.gained, got.lost) == (8, 5, 3, 2, 4)
    assert got.p_value == pytest.approx(2 * 22 / 64, abs=1e-15)
    # Symmetric in the direction of the change; 0 vs 5 discordant gives 2 / 32.
    assert paired_comparison(after, before).p_value == got.p_value
    assert paired_comparison([0] * 5, [1] * 5).p_value == pytest.approx(2 / 32, abs=1e-15)


def test_paired_comparison_matches_the_binomial_sum_by_enumeration():
    # P[Binomial(m, 1/2) <= k] counted over all 2^m outcomes of the discordant problems.
    for gained, lost in [(0, 0), (1, 0), (3, 1), (2, 7), (5, 5)]:
        m = gained + lost
        tail = sum(1 for bits in range(2**m) if bin(bits).count("1") <= min(gained, lost)) / 2**m
        got = paired_comparison([0] * gained + [1] * lost + [1], [1] * gained + [0] * lost + [1])
        assert got.p_value == pytest.approx(min(1.0, 2 * tail), abs=1e-15), (gained, lost)


@pytest.mark.parametrize("before, after, match", [
    ([1, 0], [1], "equally long"),
    ([], [], "non-empty"),
    ([0.5], [1], "0/1 scores"),
    ([1], [float("nan")], "scores in"),
])
def test_paired_comparison_errors(before, after, match):
    with pytest.raises(ValueError, match=match):
        paired_comparison(before, after)


@pytest.mark.parametrize("before, after", [(["1", "0"], ["0", "1"]), ([None], [1]), ([1, 0], [0, b"1"])])
def test_paired_comparison_refuses_values_that_are_not_numbers(before, after):
    # float("1") == 1.0 once let strings through as scores, and None raised a TypeError the docstring did not promise
    with pytest.raises(ValueError, match="must be numbers"):
        paired_comparison(before, after)
    with pytest.raises(ValueError, match="must be numbers"):
        pass_at_1(before + after)


def test_paired_comparison_takes_numpy_arrays():
    import numpy as np

    got = paired_comparison(np.array([1, 0, 0, 1]), np.array([0.0, 1.0, 1.0, 1.0]))
    assert (got.n, got.before, got.after, got.gained, got.lost) == (4, 2, 3, 2, 1)
    with pytest.raises(ValueError, match="non-empty"):
        paired_comparison(np.array([]), np.array([]))


def test_paired_comparison_matches_the_minimum_likelihood_two_sided_test_exactly():
    # scipy.stats.binomtest's two-sided p (the sum of the pmf over outcomes no more likely than the observed one; scipy
    # is not installed), in exact fractions. For p = 1/2 it equals min(1, 2 · lower tail); it is 1 when |g − l| <= 1.
    from fractions import Fraction

    for gained in range(0, 26):
        for lost in range(0, 26):
            m = gained + lost
            pmf = [Fraction(math.comb(m, j), 2**m) for j in range(m + 1)]
            expected = sum(p for p in pmf if p <= pmf[gained])
            got = paired_comparison([0] * gained + [1] * lost + [0], [1] * gained + [0] * lost + [0]).p_value
            assert got == pytest.approx(float(expected), rel=1e-15, abs=0.0), (gained, lost)
            if abs(gained - lost) <= 1:
                assert got == 1.0


def test_paired_comparison_many_discordant_problems_is_exact_and_fast():
    # m = 20 000 discordant problems, gained = m/2 − 1: P[X <= m/2 − 1] = (1 − C(m, m/2)/2^m) / 2 by symmetry, so
    # p = 1 − C(m, m/2)/2^m. One math.comb per tail term took 45 s here; the running product takes well under 1 s.
    import time

    m = 20_000
    start = time.process_time()
    got = paired_comparison([0] * (m // 2 - 1) + [1] * (m // 2 + 1), [1] * (m // 2 - 1) + [0] * (m // 2 + 1))
    elapsed = time.process_time() - start
    assert got.p_value == pytest.approx(1 - math.comb(m, m // 2) / 2**m, rel=1e-15)
    assert elapsed < 5.0, f"{elapsed:.1f} CPU s"
