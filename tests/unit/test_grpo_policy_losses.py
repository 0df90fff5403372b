"""The policy-gradient terms of ``algorithm.policy_loss`` (grpo.policy_losses): GSPO, GSPO-token and CISPO against
hand computations (value and gradient), their composition with KL, entropy bonus, truncated IS weights, dual clip and
every loss aggregation, the combinations refused (spec and function), and the registry behind the spec field."""

from __future__ import annotations

import itertools
import math
from typing import get_args

import pytest
import torch

from cluster.spec import AlgorithmSpec, SpecError, load_spec_text
from grpo.kl import kl_penalty
from grpo.losses import LossAggregationName, aggregate_loss, policy_loss
from grpo.policy_losses import POLICY_LOSSES, PolicyLossName, register_policy_loss

AGGS = list(get_args(LossAggregationName))
MODES = list(get_args(PolicyLossName))

# Two sequences of 3 and 2 valid tokens (the third position of the second is padding, NaN to prove it is ignored).
LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, float("nan")]]
OLD = [[-1.1, -1.7, -0.5], [-0.5, -1.0, float("nan")]]
MASK = torch.tensor([[True, True, True], [True, True, False]])


def run(mode: str, adv, loss_agg: str = "seq-mean-token-mean", **kwargs):
    """(loss, metrics, d loss / d logp) of the hand example."""
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.tensor(OLD), torch.as_tensor(adv), MASK, loss_agg=loss_agg,
                                max_response_tokens=3, loss_mode=mode, **kwargs)
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_registry_holds_the_built_in_policy_losses():
    assert set(POLICY_LOSSES) == set(MODES) == {"ppo", "gspo", "gspo_token", "cispo"}
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"unknown policy loss 'gspoo'; expected one of"):
        run("gspoo", [1.0, 1.0], clip_eps_low=0.2, clip_eps_high=0.2)


# ---- GSPO by hand --------------------------------------------------------------------------------------------------
# Sequence log ratios: (0.1 − 0.3 + 0) / 3 = −1/15 and (0.2 − 0.2) / 2 = 0, so s = (e^{−1/15}, 1) = (0.93551, 1).
S1 = math.exp(-1 / 15)


@pytest.mark.parametrize("mode", ["gspo", "gspo_token"])
def test_gspo_hand_values_unclipped(mode):
    """ε = 0.2: s_1 = 0.9355 is inside [0.8, 1.2]. seq-mean-token-mean: loss = ½ (−A_1 s_1 − A_2 s_2); d/d logp_t of
    sequence i = ½ · (−A_i s_i / |y_i|) (∇s_i = s_i · ∇ mean_t logp_t)."""
    loss, metrics, grad = run(mode, [1.5, -0.8], clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss == pytest.approx(0.5 * (-1.5 * S1 + 0.8 * 1.0), abs=1e-6)
    expected = [[0.5 * -1.5 * S1 / 3] * 3, [0.5 * 0.8 / 2] * 2 + [0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected), rtol=0, atol=1e-7)
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((3 * S1 + 2) / 5, abs=1e-6)  # token-weighted


@pytest.mark.parametrize("mode", ["gspo", "gspo_token"])
def test_gspo_hand_values_clipped_per_sequence(mode):
    """ε_low = 0.05: s_1 = 0.9355 < 0.95. With A_1 = −1.5 < 0 the clipped side −0.95·A_1 ... min(s·A, 0.95·A) =
    0.95·A_1 = −1.425 is smaller, so the whole sequence is clipped: loss_1 = 1.425 with no gradient; with A_1 = +1.5
    the unclipped side is the min and the gradient flows (PPO's rule, per sequence)."""
    loss, metrics, grad = run(mode, [-1.5, -0.8], clip_eps_low=0.05, clip_eps_high=0.05)
    assert loss == pytest.approx(0.5 * (0.95 * 1.5 + 0.8), abs=1e-6)
    expected = [[0.0] * 3, [0.5 * 0.8 / 2] * 2 + [0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected), rtol=0, atol=1e-7)
    assert metrics["clip_fraction"].item() == pytest.approx(3 / 5)  # the 3 tokens of the clipped sequence
    loss, metrics, grad = run(mode, [1.5, -0.8], clip_eps_low=0.05, clip_eps_high=0.05)
    assert loss == pytest.approx(0.5 * (-1.5 * S1 + 0.8), abs=1e-6)
    assert grad[0, 0].item() == pytest.approx(0.5 * -1.5 * S1 / 3, abs=1e-7)
    assert metrics["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("mode", ["gspo", "gspo_token"])
def test_gspo_dual_clip_bounds_the_sequence_loss(mode):
    """Sequence 2 with logp − old = (+2, +2): s_2 = e² = 7.39; A_2 = −1: loss −min(−7.39, −1.2) = 7.39, bounded by
    c·|A| = 3 (no gradient); seq-mean-token-mean: ½ (−1.5 s_1 + 3)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [1.5, 1.0, 0.0]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.tensor(OLD).nan_to_num(), torch.tensor([1.5, -1.0]), MASK,
                                clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0, loss_mode=mode,
                                loss_agg="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (-1.5 * S1 + 3.0), abs=1e-5)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(2 / 5)
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_aggregations_weigh_the_sequence_loss(agg):
    """ℓ = (−1.5 s_1, 0.8) at every token of its sequence: seq-mean-token-mean ½(ℓ_1 + ℓ_2); token-mean
    (3ℓ_1 + 2ℓ_2) / 5; seq-mean-token-sum-norm (3ℓ_1 + 2ℓ_2) / (2 · 3)."""
    loss, _, grad = run("gspo", [1.5, -0.8], loss_agg=agg, clip_eps_low=0.2, clip_eps_high=0.2)
    l1, l2 = -1.5 * S1, 0.8
    expected = {"seq-mean-token-mean": (l1 + l2) / 2, "token-mean": (3 * l1 + 2 * l2) / 5,
                "seq-mean-token-sum-norm": (3 * l1 + 2 * l2) / 6}[agg]
    assert loss == pytest.approx(expected, abs=1e-6)
    weight = {"seq-mean-token-mean": (1 / 2, 1 / 2), "token-mean": (3 / 5, 2 / 5),
              "seq-mean-token-sum-norm": (3 / 6, 2 / 6)}[agg]  # d loss / d ℓ_i
    assert grad[0, 0].item() == pytest.approx(weight[0] * l1 / 3, abs=1e-7)  # d ℓ_1 / d logp_t = ℓ_1 / |y_1|
    assert grad[1, 0].item() == pytest.approx(weight[1] * l2 / 2, abs=1e-7)


def test_gspo_refuses_per_token_advantages_and_gspo_token_takes_them():
    adv = torch.tensor([[1.0, 0.5, 0.0], [0.2, 0.2, 0.0]])
    with pytest.raises(ValueError, match=r"'gspo' needs one advantage per sequence.*sequence 0 varies.*gspo_token"):
        run("gspo", adv, clip_eps_low=0.2, clip_eps_high=0.2)
    loss, _, grad = run("gspo_token", adv, loss_agg="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    # per token −A_t · s_i (value), gradient −A_t · s_i / 5 (token-mean over 5 tokens)
    assert loss == pytest.approx(-(S1 * (1.0 + 0.5 + 0.0) + 1.0 * (0.2 + 0.2)) / 5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-S1 / 5, -0.5 * S1 / 5, 0.0], [-0.2 / 5, -0.2 / 5, 0.0]]),
                               rtol=0, atol=1e-7)


# ---- CISPO by hand -------------------------------------------------------------------------------------------------
def test_cispo_hand_values():
    """r = e^{(0.1, −0.3, 0), (0.2, −0.2)}; w = clip(r, 0.9, 1.1) = (1.1, 0.9, 1, 1.1, 0.9) (e^{0.1} = 1.105 and
    e^{0.2} = 1.221 above 1.1, e^{−0.3} and e^{−0.2} below 0.9); pg_t = −w_t·A·logp_t; token-mean over 5 tokens;
    gradient −w_t·A / 5 (the weight is detached)."""
    w = [[1.1, 0.9, 1.0], [1.1, 0.9]]
    adv = [2.0, -1.0]
    loss, metrics, grad = run("cispo", adv, loss_agg="token-mean", clip_eps_low=0.1, clip_eps_high=0.1)
    expected = -sum(w[i][t] * adv[i] * LOGP[i][t] for i in range(2) for t in range(len(w[i]))) / 5
    assert loss == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-w[0][t] * 2.0 / 5 for t in range(3)],
                                                   [w[1][0] / 5, w[1][1] / 5, 0.0]]), rtol=0, atol=1e-7)
    assert metrics["clip_fraction"].item() == pytest.approx(4 / 5)  # every weight truncated but the ratio-1 token
    r = [math.exp(0.1), math.exp(-0.3), 1.0, math.exp(0.2), math.exp(-0.2)]
    assert metrics["ratio_mean"].item() == pytest.approx(sum(r) / 5, abs=1e-6)


def test_cispo_keeps_the_gradient_ppo_clips_away():
    """A token with ratio e^{0.5} = 1.65 > 1.2 and A > 0: PPO's clipped side is the min, its gradient is 0; CISPO's
    weight is truncated to 1.2 and the token still gets −1.2·A·∇logp."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    for mode, expected in (("ppo", 0.0), ("cispo", -1.2)):
        loss, _ = policy_loss(logp, torch.tensor([[-0.5]]), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                              clip_eps_low=0.2, clip_eps_high=0.2, loss_mode=mode)
        (grad,) = torch.autograd.grad(loss, logp)
        assert grad.item() == pytest.approx(expected), mode


def test_cispo_refuses_a_dual_clip():
    with pytest.raises(ValueError, match=r"policy loss 'cispo' takes no dual_clip_c.*algorithm.dual_clip_c must be "
                                         r"null with algorithm.policy_loss 'cispo'"):
        run("cispo", [1.0, 1.0], clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)


# ---- every mode: first iteration, composition, equivalences ---------------------------------------------------------
def random_batch(seed: int, n: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 6][:n])
    mask = torch.arange(t)[None] < lengths[:, None]
    logp = -torch.rand(n, t, generator=g) * 3
    return dict(logp=logp, old=logp - 0.3 * torch.randn(n, t, generator=g), ref=logp - 0.2 * torch.rand(n, t),
                ent=torch.rand(n, t, generator=g) * 2, adv=torch.randn(n, generator=g),
                tis=torch.rand(n, t, generator=g) * 2, mask=mask)


def grad_of(mode, d, agg, old=None, **kwargs):
    logp = d["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(logp, d["old"] if old is None else old, d["adv"], d["mask"], loss_agg=agg,
                                max_response_tokens=7, loss_mode=mode, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, metrics


@pytest.mark.parametrize("agg", AGGS)
def test_every_mode_has_the_policy_gradient_at_the_first_iteration(agg):
    """current = proximal (ratio 1, one iteration): PPO, GSPO-token and CISPO give −A·∇logp per token under every
    aggregation; GSPO under seq-mean-token-mean gives the same (its −A_i ∇ mean_t logp_t is the per-token mean)."""
    d = random_batch(0)
    _, reference, _ = grad_of("ppo", d, agg, old=d["logp"], clip_eps_low=0.2, clip_eps_high=0.2)
    assert reference.abs().max() > 0.01
    for mode in MODES:
        _, grad, metrics = grad_of(mode, d, agg, old=d["logp"], clip_eps_low=0.2, clip_eps_high=0.2)
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-7, msg=lambda m: f"{mode}: {m}")
        assert metrics["clip_fraction"].item() == 0.0 and metrics["ratio_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("agg", AGGS)
def test_modes_differ_once_the_policy_moved(agg):
    d = random_batch(1)
    grads = {mode: grad_of(mode, d, agg, clip_eps_low=0.1, clip_eps_high=0.1)[1] for mode in MODES}
    for a, b in itertools.combinations(["ppo", "gspo", "cispo"], 2):
        assert (grads[a] - grads[b]).abs().max() > 1e-3, (a, b)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_gspo_token_equals_gspo_with_sequence_advantages(agg, dual):
    """Value and gradient, with KL, entropy, sequence-level TIS weights and dual clip on, under every aggregation.
    Token-level TIS weights that vary within a sequence make them differ, as documented: gspo spreads the sequence's
    summed weight evenly over its tokens' gradients, gspo_token weighs each token's own gradient."""
    d = random_batch(5)
    neg = next(i for i in range(5) if d["adv"][i] < 0 and d["mask"][i].any())
    d["old"][neg] = d["logp"][neg] - 1.5  # s = e^1.5 > dual_clip_c with A < 0: the dual clip is active there
    seq_tis = d["tis"][:, :1].expand_as(d["tis"])
    options = dict(clip_eps_low=0.02, clip_eps_high=0.03, dual_clip_c=dual, ref_logprobs=d["ref"], kl_coef=0.05,
                   entropy=d["ent"], entropy_coef=0.01)
    loss_a, grad_a, m_a = grad_of("gspo", d, agg, **options, tis_weights=seq_tis)
    loss_b, grad_b, m_b = grad_of("gspo_token", d, agg, **options, tis_weights=seq_tis)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-5, atol=1e-7)
    assert 0 < m_a["clip_fraction"].item() < 1 and m_a["clip_fraction"] == m_b["clip_fraction"]
    if dual is not None:
        assert m_a["dual_clip_fraction"].item() > 0 and m_a["dual_clip_fraction"] == m_b["dual_clip_fraction"]
    loss_a, grad_a, _ = grad_of("gspo", d, agg, **options, tis_weights=d["tis"])
    loss_b, grad_b, _ = grad_of("gspo_token", d, agg, **options, tis_weights=d["tis"])
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and (grad_a - grad_b).abs().max() > 1e-3


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_composes_with_kl_entropy_and_tis(mode, agg):
    """loss(pg·TIS + β·KL − c·H) = aggregate(pg·TIS) + β·aggregate(KL) − c·aggregate(H), in value and gradient: the
    extra terms add to each mode's term exactly as they do to PPO's."""
    d = random_batch(3)
    clip = dict(clip_eps_low=0.1, clip_eps_high=0.15)
    loss, grad, metrics = grad_of(mode, d, agg, **clip, ref_logprobs=d["ref"], kl_coef=0.05, entropy=d["ent"],
                                  entropy_coef=0.01, tis_weights=d["tis"])
    pg_loss, pg_grad, _ = grad_of(mode, d, agg, **clip, tis_weights=d["tis"])
    logp = d["logp"].clone().requires_grad_()
    counts = dict(max_response_tokens=7)
    extra = 0.05 * aggregate_loss(kl_penalty(logp, d["ref"], "k3"), d["mask"], agg, **counts) \
        - 0.01 * aggregate_loss(d["ent"], d["mask"], agg, **counts)
    extra.backward()
    assert loss == pytest.approx(pg_loss + extra.item(), abs=1e-6)
    torch.testing.assert_close(grad, pg_grad + logp.grad, rtol=1e-5, atol=1e-7)
    assert metrics["pg_loss"].item() == pytest.approx(pg_loss, abs=1e-6)
    no_tis, _, _ = grad_of(mode, d, agg, **clip)
    assert abs(no_tis - pg_loss) > 1e-4  # the TIS weights reach the term


# ---- the spec field ------------------------------------------------------------------------------------------------
MINIMAL = "output_dir: runs/t\ntotal_steps: 1\ndata:\n  train_path: train.jsonl\n"


def test_spec_policy_loss_defaults_to_ppo_and_takes_every_registered_mode():
    assert AlgorithmSpec().policy_loss == "ppo"
    for mode in MODES:
        assert load_spec_text(MINIMAL, source="job.yaml",
                              overrides=[f"algorithm.policy_loss={mode}"]).algorithm.policy_loss == mode


def test_spec_refuses_gspo_with_kl_in_reward_naming_the_fields():
    with pytest.raises(SpecError, match=r"algorithm\.policy_loss: policy_loss='gspo' needs one advantage per "
                                        r"sequence, but algorithm\.kl_in_reward=true makes them per token; expected "
                                        r"policy_loss 'gspo_token'"):
        load_spec_text(MINIMAL, source="job.yaml", overrides=["algorithm.policy_loss=gspo",
                                                               "algorithm.kl_in_reward=true"])
    spec = load_spec_text(MINIMAL, source="job.yaml", overrides=["algorithm.policy_loss=gspo_token",
                                                                  "algorithm.kl_in_reward=true"])
    assert spec.algorithm.kl_in_reward


def test_spec_refuses_cispo_with_dual_clip_naming_the_field():
    with pytest.raises(SpecError, match=r"algorithm\.dual_clip_c: dual_clip_c=3\.0 bounds a clipped surrogate's "
                                        r"loss, and policy_loss='cispo' has none"):
        load_spec_text(MINIMAL, source="job.yaml", overrides=["algorithm.policy_loss=cispo",
                                                               "algorithm.dual_clip_c=3"])
    for mode in ("ppo", "gspo", "gspo_token"):
        assert AlgorithmSpec(policy_loss=mode, dual_clip_c=3.0).dual_clip_c == 3.0
