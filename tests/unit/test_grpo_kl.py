"""Unit tests for grpo.kl: estimator values, k3 range/finiteness, unbiasedness, controllers, KL in the reward,
registry."""

import math
from typing import get_args

import pytest
import torch

from grpo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimatorName,
    kl_penalty,
    kl_reward_advantages,
    register_kl_estimator,
)


def test_registry_holds_exactly_the_literal_names():
    assert set(KL_ESTIMATORS) == set(get_args(KLEstimatorName))


def test_hand_values():
    logp = torch.tensor([[-1.0, -0.5, -3.0]])
    ref = torch.tensor([[-2.0, -0.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[1.0, 0.0, -2.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.5, 0.0, 2.0]]))
    # d = ref - logp = [-1, 0, 2]
    expected_k3 = torch.tensor([[math.exp(-1) + 1 - 1, 0.0, math.exp(2) - 2 - 1]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected_k3)
    assert kl_penalty(logp, ref).equal(kl_penalty(logp, ref, "k3"))


def test_k3_nonnegative_and_finite_over_range_and_beyond():
    d = torch.cat([torch.linspace(-20, 20, 4001), torch.tensor([1e-8, -1e-8, 3e-7, -3e-7, 1e4, -1e4, 88.0, 200.0])])
    logp = torch.zeros_like(d)
    k3 = kl_penalty(logp.unsqueeze(0), d.unsqueeze(0), "k3")
    assert torch.isfinite(k3).all()
    assert (k3 >= 0).all()
    assert k3[0, -2] == pytest.approx(math.exp(20) - 21, rel=1e-5)  # d = 88 clamped to 20
    assert k3[0, -3] == pytest.approx(math.exp(-20) + 19, rel=1e-6)  # d = -1e4 clamped to -20


def test_k3_gradient_finite_and_matches_formula():
    logp = torch.tensor([[-1.0, -2.0, -50.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    kl_penalty(logp, ref, "k3").sum().backward()
    # d/dlogp (e^d - d - 1) with d = ref - logp is 1 - e^d; 0 where d is clamped
    d = (ref - logp.detach())
    expected = torch.where(d.abs() <= 20, 1 - d.exp(), torch.zeros_like(d))
    torch.testing.assert_close(logp.grad, expected)
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_match_true_kl_in_expectation(estimator):
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    est = kl_penalty(p.log()[samples].unsqueeze(0), q.log()[samples].unsqueeze(0), estimator).mean()
    assert float(est) == pytest.approx(true_kl, abs=3e-3)


def test_shape_mismatch_and_unknown_estimator():
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "k1")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k4")


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_kl_estimator("k3")(lambda logp, ref: logp - ref)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-0.1)


def test_adaptive_controller_ziegler_update():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctl.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10_000))
    before = ctl.value
    ctl.update(current_kl=6.0, n_steps=100)  # on target
    assert ctl.value == pytest.approx(before)
    ctl.update(current_kl=torch.tensor(6.6), n_steps=100)  # error 0.1, unclipped; tensor accepted
    assert ctl.value == pytest.approx(before * (1 + 0.1 * 0.01))
    before = ctl.value
    ctl.update(current_kl=0.0, n_steps=100)  # error clipped to -0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 0.01))


@pytest.mark.parametrize("kwargs", [dict(init_kl_coef=0.0), dict(target_kl=0.0), dict(horizon=-1.0),
                                    dict(target_kl=float("nan"))])
def test_adaptive_controller_validation(kwargs):
    args = dict(init_kl_coef=0.1, target_kl=6.0, horizon=10_000) | kwargs
    with pytest.raises(ValueError):
        AdaptiveKLController(**args)


def test_adaptive_controller_rejects_bad_updates():
    ctl = AdaptiveKLController(0.1, 6.0, 10_000)
    with pytest.raises(ValueError, match="finite"):
        ctl.update(float("nan"), 1)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, -1)


def test_adaptive_controller_steers_measured_kl_to_target():
    # A toy policy whose KL responds inversely to beta (KL = 0.002 / beta): the controller must settle where
    # KL = target, i.e. beta = 0.2, from either side.
    for init in (0.01, 1.0):
        ctl = AdaptiveKLController(init_kl_coef=init, target_kl=0.01, horizon=1000)
        for _ in range(3000):
            ctl.update(0.002 / ctl.value, n_steps=64)
        assert 0.002 / ctl.value == pytest.approx(0.01, rel=0.02)


def test_kl_in_reward_is_the_return_to_go_of_the_per_token_penalty():
    adv = torch.tensor([1.0, -0.5])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, float("nan"), 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = kl_reward_advantages(adv, kl, mask, kl_coef=0.5)
    # row 0: penalties to go [0.6, 0.5, 0.3]; row 1: [0.4] then masked
    torch.testing.assert_close(out, torch.tensor([[0.7, 0.75, 0.85], [-0.7, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert not out.requires_grad
    zero = kl_reward_advantages(adv, kl, mask, kl_coef=0.0)
    torch.testing.assert_close(zero, torch.tensor([[1.0, 1.0, 1.0], [-0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="advantages must have shape"):
        kl_reward_advantages(torch.zeros(3), kl, mask, 0.1)
    with pytest.raises(ValueError, match="kl_coef must be finite"):
        kl_reward_advantages(adv, kl, mask, math.inf)


def test_kl_controllers_state_round_trip():
    from grpo.kl import AdaptiveKLController, FixedKLController

    adaptive = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    adaptive.update(0.5, 10)
    restored = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value != 0.1
    fixed = FixedKLController(0.2)
    fixed.load_state_dict({"kl_coef": 0.3})
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="kl_coef"):
        fixed.load_state_dict({"kl_coef": float("nan")})
