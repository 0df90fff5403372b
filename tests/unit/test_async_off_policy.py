"""Off-policy correction (``grpo.off_policy``, issue 17) against hand-computed values, and the ``algorithm.tis_level``
/ ``algorithm.mis`` spec fields.

The batch used throughout (N = 2, T = 3; sequence 1 has 2 valid tokens; token (0, 2) has a NaN engine logprob):

    old        [[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]
    behaviour  [[-1.5, -1.0,  nan], [-1.0, -3.0, 0.0]]
    log ρ      [[ 0.5, -1.0,  0  ], [ 0.0,  2.0, 0  ]]     (NaN engine logprob and padding: 0, ratio 1)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cluster.spec import AlgorithmSpec, MisSpec, SpecError, load_spec
from grpo import (
    behaviour_kl_k3,
    check_mis_band,
    importance_log_ratio,
    importance_weights,
    masked_fraction,
    mis_keep_mask,
    policy_loss,
    ratio_quantiles,
    sequence_log_ratio,
    staleness_histogram,
    truncated_importance_weights,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml"
E = math.e


def batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    behaviour = torch.tensor([[-1.5, -1.0, float("nan")], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return old, behaviour, mask


def test_async_log_ratio_and_sequence_ratios():
    old, behaviour, mask = batch()
    log_ratio, known = importance_log_ratio(old, behaviour, mask)
    assert torch.equal(log_ratio, torch.tensor([[0.5, -1.0, 0.0], [0.0, 2.0, 0.0]]))
    assert torch.equal(known, torch.tensor([[True, True, False], [True, True, False]]))
    assert torch.allclose(sequence_log_ratio(log_ratio, mask, "sum"), torch.tensor([-0.5, 2.0]))
    assert torch.allclose(sequence_log_ratio(log_ratio, mask, "mean"), torch.tensor([-0.5 / 3, 1.0]))
    # a huge gap is clamped to ±20 before exp, as grpo.losses does
    far, _ = importance_log_ratio(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.tensor([[True]]))
    assert float(far) == 20.0


def test_async_token_tis_is_todays_truncated_weights():
    old, behaviour, mask = batch()
    w = importance_weights(old, behaviour, mask, cap=2.0, level="token")
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, 2.0, 0.0]])
    assert torch.allclose(w, expected)
    assert torch.equal(w, truncated_importance_weights(old, behaviour, mask, 2.0))  # bit for bit


def test_async_sequence_tis_hand_values():
    old, behaviour, mask = batch()
    w = importance_weights(old, behaviour, mask, cap=2.0, level="sequence")
    # sequence 0: exp(0.5 − 1 + 0) = e^−0.5 on all 3 tokens; sequence 1: min(e^2, 2) = 2, padding 0
    s0 = math.exp(-0.5)
    assert torch.allclose(w, torch.tensor([[s0, s0, s0], [2.0, 2.0, 0.0]]))
    w10 = importance_weights(old, behaviour, mask, cap=10.0, level="sequence")
    assert torch.allclose(w10[1], torch.tensor([E**2, E**2, 0.0]))
    # a sequence whose every engine logprob is NaN: ratio 1, weight min(1, C)
    nan = torch.full((1, 2), float("nan"))
    assert torch.equal(importance_weights(torch.zeros(1, 2), nan, torch.ones(1, 2, dtype=torch.bool), 0.5,
                                          "sequence"), torch.tensor([[0.5, 0.5]]))
    # a sequence ratio beyond e^20 stays finite (clamped, then capped)
    long = importance_weights(torch.zeros(1, 4), torch.full((1, 4), -10.0), torch.ones(1, 4), 1e12, "sequence")
    assert torch.allclose(long, torch.full((1, 4), math.exp(20.0)))


def test_async_token_mis_hand_values():
    old, behaviour, mask = batch()
    keep = mis_keep_mask(old, behaviour, mask, low=0.5, high=2.0, level="token")
    # ratios e^0.5 = 1.65 kept, e^−1 = 0.37 dropped, NaN engine logprob kept (no correction); 1 kept, e^2 dropped
    assert torch.equal(keep, torch.tensor([[True, False, True], [True, False, False]]))
    assert float(masked_fraction(keep, mask)) == pytest.approx(2 / 5)
    # the band is closed: a ratio exactly at a bound is kept
    at = mis_keep_mask(torch.tensor([[0.0, 0.0]]), torch.tensor([[-math.log(2.0), math.log(2.0)]]),
                       torch.ones(1, 2), low=0.5, high=2.0)
    assert torch.equal(at, torch.tensor([[True, True]]))


def test_async_sequence_mis_hand_values():
    old, behaviour, mask = batch()
    keep = mis_keep_mask(old, behaviour, mask, low=0.5, high=2.0, level="sequence")
    # geometric means: sequence 0 exp(−0.5/3) = 0.846 kept whole; sequence 1 exp(2/2) = e = 2.72 dropped whole
    assert torch.equal(keep, torch.tensor([[True, True, True], [False, False, False]]))
    assert float(masked_fraction(keep, mask)) == pytest.approx(2 / 5)
    assert torch.equal(mis_keep_mask(old, behaviour, mask, low=0.5, high=3.0, level="sequence"), mask)


@pytest.mark.parametrize(("low", "high", "message"), [
    (0.0, 2.0, "low must be a finite number in \\(0, inf\\), got 0.0"),
    (-1.0, 2.0, "low must be a finite number in \\(0, inf\\), got -1.0"),
    (0.5, math.inf, "high must be a finite number in \\(0, inf\\), got inf"),
    (0.5, math.nan, "high must be a finite number"),
    (2.0, 2.0, "low < high, got low=2.0, high=2.0"),
    (3.0, 2.0, "low < high, got low=3.0, high=2.0"),
])
def test_async_mis_band_refused(low, high, message):
    with pytest.raises(ValueError, match=message):
        check_mis_band(low, high)
    old, behaviour, mask = batch()
    with pytest.raises(ValueError, match=message):
        mis_keep_mask(old, behaviour, mask, low, high)


def test_async_bad_shapes_and_names_refused():
    old, behaviour, mask = batch()
    with pytest.raises(ValueError, match=r"behaviour_logprobs must have shape \(2, 3\)"):
        importance_log_ratio(old, behaviour[:, :2], mask)
    with pytest.raises(ValueError, match=r"response_mask must have shape \(2, 3\)"):
        mis_keep_mask(old, behaviour, mask[:1], 0.5, 2.0)
    with pytest.raises(ValueError, match=r"unknown TIS level 'batch'; expected one of \['sequence', 'token'\]"):
        importance_weights(old, behaviour, mask, 2.0, "batch")
    with pytest.raises(ValueError, match=r"unknown MIS level 'batch'; expected one of \['sequence', 'token'\]"):
        mis_keep_mask(old, behaviour, mask, 0.5, 2.0, "batch")
    with pytest.raises(ValueError, match="cap must be finite and > 0"):
        importance_weights(old, behaviour, mask, 0.0, "sequence")
    with pytest.raises(ValueError, match="old_logprobs must be \\[N, T\\]"):
        importance_log_ratio(old[0], behaviour[0], mask[0])


def test_async_mis_keep_mask_drops_tokens_from_numerator_and_denominator():
    # The loss over the kept tokens equals the loss of a batch without the dropped tokens, and with kept global
    # counts two micro-batches add up to it.
    old, behaviour, mask = batch()
    logprobs = old + torch.tensor([[0.1, -0.2, 0.05], [0.0, 0.3, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    keep = mis_keep_mask(old, behaviour, mask, 0.5, 2.0)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.2)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = policy_loss(logprobs, old, adv, keep, loss_agg=agg, max_response_tokens=3, **kw)
        # by hand: kept tokens (0,0), (0,2), (1,0); pg = −min(r·A, clip(r)·A)
        r00, r02, r10 = math.exp(0.1), math.exp(0.05), 1.0
        pg = [-min(r00, 1.2) * 1.0, -min(r02, 1.2) * 1.0, -max(r10, 0.8) * -2.0]
        want = {"token-mean": sum(pg) / 3, "seq-mean-token-mean": ((pg[0] + pg[1]) / 2 + pg[2]) / 2,
                "seq-mean-token-sum-norm": sum(pg) / (2 * 3)}[agg]
        assert float(loss) == pytest.approx(want, rel=1e-6)
        n_tok, n_seq = int(keep.sum()), int(keep.any(-1).sum())
        parts = [policy_loss(logprobs[i:i + 1], old[i:i + 1], adv[i:i + 1], keep[i:i + 1], loss_agg=agg,
                             num_tokens=n_tok, num_sequences=n_seq, max_response_tokens=3, **kw)[0] for i in (0, 1)]
        assert float(sum(parts)) == pytest.approx(float(loss), rel=1e-6)


def test_async_all_corrections_off_leave_the_loss_bit_for_bit():
    # The trainer with tis_cap null and mis null passes tis_weights=None and the response mask itself; a band wide
    # enough to keep every token gives back the same mask, and the token TIS helper is today's function, so the loss
    # and its gradient are unchanged bit for bit.
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    behaviour = old - 0.3 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    adv = torch.randn(4, generator=g)
    keep = mis_keep_mask(old, behaviour, mask, 1e-6, 1e6)
    assert torch.equal(keep, mask)

    def run(m, tis):
        logp = (old + 0.1 * torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = policy_loss(logp, old, adv, m, clip_eps_low=0.2, clip_eps_high=0.28, tis_weights=tis)
        loss.backward()
        return loss.detach(), logp.grad

    today = run(mask, truncated_importance_weights(old, behaviour, mask, 2.0))
    now = run(keep, importance_weights(old, behaviour, mask, 2.0, "token"))
    assert torch.equal(today[0], now[0]) and torch.equal(today[1], now[1])
    assert torch.equal(run(mask, None)[0], run(keep, None)[0])


def test_async_ratio_quantiles_hand_values():
    old, behaviour, mask = batch()
    log_ratio, known = importance_log_ratio(old, behaviour, mask)
    # known ratios sorted: e^−1, 1, e^0.5, e^2 (linear interpolation between order statistics)
    q = ratio_quantiles(log_ratio, known, (0.0, 0.01, 0.5, 0.99, 1.0))
    lo, one, mid, hi = math.exp(-1), 1.0, math.exp(0.5), math.exp(2)
    want = [lo, lo + 0.03 * (one - lo), (one + mid) / 2, mid + 0.97 * (hi - mid), hi]
    assert torch.allclose(q, torch.tensor(want))
    assert torch.isnan(ratio_quantiles(log_ratio, torch.zeros_like(known))).all()
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\]"):
        ratio_quantiles(log_ratio, known, (0.5, 1.5))


def test_async_behaviour_kl_k3_hand_values():
    old, behaviour, mask = batch()
    k3, known = behaviour_kl_k3(old, behaviour, mask)
    # k3 = r − 1 − log r with r = exp(current − behaviour): 0.5 → e^0.5 − 1.5; −1 → e^−1; 0 → 0; 2 → e^2 − 3
    want = torch.tensor([[math.exp(0.5) - 1.5, math.exp(-1.0), 0.0], [0.0, E**2 - 3.0, 0.0]])
    assert torch.allclose(k3, want)
    assert int(known.sum()) == 4 and bool((k3 >= 0).all())
    # k3 estimates KL(π_b ‖ π_θ): averaged over exact samples of π_b it equals the true KL
    pb, pt = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.5, 0.3, 0.2])
    lb, lt = pb.log().expand(1, 3), pt.log().expand(1, 3)
    k3_all, _ = behaviour_kl_k3(lt, lb, torch.ones(1, 3, dtype=torch.bool))
    assert float((pb * k3_all[0]).sum()) == pytest.approx(float((pb * (pb / pt).log()).sum()), rel=1e-5)


def test_async_staleness_histogram():
    assert staleness_histogram([0, 2, 1, 0, 0, 2]) == {0: 3, 1: 1, 2: 2}
    assert list(staleness_histogram([3, 0, 3])) == [0, 3]
    assert staleness_histogram(torch.tensor([1, 1, 0])) == {0: 1, 1: 2}
    assert staleness_histogram([]) == {}
    with pytest.raises(ValueError, match=r"staleness must be >= 0 \(versions behind\), got \[-1\]"):
        staleness_histogram([0, -1])
    with pytest.raises(ValueError, match="staleness values must be ints, got \\[1.0, True\\]"):
        staleness_histogram([0, 1.0, True])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        staleness_histogram(torch.tensor([0.0, 1.0]))


def test_async_spec_defaults_are_todays_behaviour():
    alg = load_spec(EXAMPLE).algorithm
    assert alg.tis_cap is None and alg.tis_level == "token" and alg.mis is None
    spec = load_spec(EXAMPLE, ["algorithm.tis_cap=2", "algorithm.tis_level=sequence", "algorithm.mis.level=token",
                               "algorithm.mis.low=0.5", "algorithm.mis.high=2"])
    assert spec.algorithm.tis_cap == 2.0 and spec.algorithm.tis_level == "sequence"
    assert spec.algorithm.mis == MisSpec(level="token", low=0.5, high=2.0)
    assert AlgorithmSpec(mis={"level": "sequence", "low": 0.9, "high": 1.1}).mis.level == "sequence"


@pytest.mark.parametrize(("sets", "field", "message"), [
    (["algorithm.mis.level=token", "algorithm.mis.low=0", "algorithm.mis.high=2"], "algorithm.mis.low",
     "greater than or equal to 0.00000000206"),  # e^-20: the ratio is clamped there
    (["algorithm.mis.level=token", "algorithm.mis.low=0.5", "algorithm.mis.high=-1"], "algorithm.mis.high",
     "greater than 0"),
    (["algorithm.mis.level=token", "algorithm.mis.low=0.5", "algorithm.mis.high=.inf"], "algorithm.mis.high",
     "finite number"),
    (["algorithm.mis.level=token", "algorithm.mis.low=2", "algorithm.mis.high=2"], "algorithm.mis.high",
     "expected the MIS band low < high, got low=2.0, high=2.0"),
    (["algorithm.mis.level=token", "algorithm.mis.low=3", "algorithm.mis.high=2"], "algorithm.mis.high",
     "low < high, got low=3.0, high=2.0"),
    (["algorithm.mis.level=token", "algorithm.mis.low=1.5", "algorithm.mis.high=2"], "algorithm.mis.low",
     "hold ratio 1 (low < 1 < high: on-policy tokens are kept), got low=1.5"),
    (["algorithm.mis.level=sequence", "algorithm.mis.low=1e-3", "algorithm.mis.high=1e-2"], "algorithm.mis.high",
     "hold ratio 1 (low < 1 < high: on-policy tokens are kept), got high=0.01"),
    (["algorithm.mis.level=token", "algorithm.mis.low=1", "algorithm.mis.high=2"], "algorithm.mis.low",
     "got low=1.0"),
    (["algorithm.mis.level=batch", "algorithm.mis.low=0.5", "algorithm.mis.high=2"], "algorithm.mis.level",
     "unknown MIS level 'batch'; expected one registered in grpo.off_policy.MIS_LEVELS: sequence, token."),
    (["algorithm.mis.low=0.5", "algorithm.mis.high=2"], "algorithm.mis.level", "required key 'level' is missing"),
    (["algorithm.tis_level=sequence"], "algorithm.tis_level",
     "tis_level='sequence' needs algorithm.tis_cap (the truncation cap), got null"),
])
def test_async_spec_refusals_name_the_field(sets, field, message):
    with pytest.raises(SpecError) as info:
        load_spec(EXAMPLE, sets)
    text = str(info.value)
    assert f": {field}: " in text or f"--set {field}: " in text, text  # a --set of the field names it once
    assert message in text, text
