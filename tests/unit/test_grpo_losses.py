"""Unit tests for grpo.losses: aggregation hand values, micro-batch additivity, clipping, masking, gradients."""

import math
from typing import get_args

import pytest
import torch

from grpo.advantages import compute_advantages
from grpo.kl import kl_penalty
from grpo.losses import (
    LOSS_AGGREGATIONS,
    LossAggregationName,
    aggregate_loss,
    policy_loss,
    register_loss_aggregation,
    truncated_importance_weights,
)

AGGS = list(get_args(LossAggregationName))
CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.2)


def lengths_mask(lengths, t):
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def single_token(ratio, adv, **kwargs):
    """policy_loss on one valid token with the given importance ratio and advantage; returns loss, metrics, grad."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool),
                                **kwargs)
    loss.backward()
    return loss.item(), metrics, logp.grad.item()


def test_registry_holds_exactly_the_literal_names():
    assert set(LOSS_AGGREGATIONS) == set(AGGS)
    with pytest.raises(ValueError, match="already registered"):
        register_loss_aggregation("token-mean")(lambda *a, **k: None)


PER_TOKEN = torch.tensor([[2, 2, 2, 2, 2, 6, 5, 3, 2, 4], [10, 3, 4, 5, 2, 3, 4, 1, 1, 3]], dtype=torch.float32)
MASK = lengths_mask([5, 1], 10)


def test_aggregate_hand_values():
    assert aggregate_loss(PER_TOKEN, MASK, "token-mean").item() == pytest.approx(20 / 6, abs=1e-5)
    assert aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-mean").item() == pytest.approx(6.0, abs=1e-6)
    dr = aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm", max_response_tokens=10)
    assert dr.item() == pytest.approx(20 / (2 * 10), abs=1e-6)
    assert aggregate_loss(PER_TOKEN, MASK.float(), "token-mean").item() == pytest.approx(20 / 6, abs=1e-5)


def test_aggregate_default_counts_skip_empty_sequences_and_global_counts_override():
    per_token = torch.cat([PER_TOKEN, torch.full((1, 10), 99.0)])
    mask = torch.cat([MASK, torch.zeros(1, 10, dtype=torch.bool)])
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(6.0)
    dr = aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", max_response_tokens=10)
    assert dr.item() == pytest.approx(1.0)
    assert aggregate_loss(per_token, mask, "token-mean", num_tokens=12).item() == pytest.approx(20 / 12)
    assert aggregate_loss(per_token, mask, "token-mean", num_tokens=torch.tensor(12)).item() == pytest.approx(20 / 12)
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean", num_sequences=4).item() == pytest.approx(3.0)


def test_aggregate_ignores_nan_and_inf_under_mask_in_value_and_grad():
    per_token = PER_TOKEN.clone()
    per_token[0, 7] = float("nan")
    per_token[1, 3] = float("inf")
    per_token.requires_grad_()
    for agg in AGGS:
        per_token.grad = None
        loss = aggregate_loss(per_token, MASK, agg, max_response_tokens=10)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(per_token.grad).all()
        assert (per_token.grad[~MASK] == 0).all()


def test_aggregate_empty_mask_gives_zero_and_errors():
    empty = torch.zeros(2, 10, dtype=torch.bool)
    for agg in AGGS:
        assert aggregate_loss(PER_TOKEN, empty, agg, max_response_tokens=10).item() == 0.0
    with pytest.raises(ValueError, match="requires max_response_tokens"):
        aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(PER_TOKEN, MASK, "sum")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(PER_TOKEN, MASK, "token-mean", num_tokens=-1)
    with pytest.raises(ValueError, match="response_mask must have shape"):
        aggregate_loss(PER_TOKEN, MASK[:, :5], "token-mean")


def test_grpo_hand_example_length_bias():
    adv = compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "grpo", std="unbiased")
    torch.testing.assert_close(adv, torch.tensor([0.70711, -0.70711]), atol=1e-5, rtol=0)
    mask = lengths_mask([2, 4], 4)
    logp = torch.full((2, 4), -1.3)
    common = dict(**CLIP, kl_coef=0.0)
    seq_mean, _ = policy_loss(logp, logp.clone(), adv, mask, loss_agg="seq-mean-token-mean", **common)
    tok_mean, metrics = policy_loss(logp, logp.clone(), adv, mask, loss_agg="token-mean", **common)
    assert seq_mean.item() == pytest.approx(0.0, abs=1e-6)
    assert tok_mean.item() == pytest.approx(0.23570, abs=1e-5)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["clip_fraction"].item() == 0.0
    assert metrics["pg_loss"].item() == pytest.approx(0.23570, abs=1e-5)
    assert metrics["num_tokens_local"].item() == 6 and metrics["num_sequences_local"].item() == 2


def random_batch(n=6, t=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    lengths[2] = 0  # one sequence with no valid token
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    logp = -torch.rand(n, t, generator=gen) * 3
    old = logp + torch.randn(n, t, generator=gen) * 0.3  # ratios inside and outside the clip range
    ref = logp + torch.randn(n, t, generator=gen) * 0.5
    ent = torch.rand(n, t, generator=gen)
    adv = torch.randn(n, generator=gen)
    for x in (logp, old, ref, ent):
        x[~mask] = float("nan")
    return logp, old, ref, ent, adv, mask


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_with_global_counts_add_up_to_full_batch(agg):
    logp, old, ref, ent, adv, mask = random_batch()
    kwargs = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, loss_agg=agg, ref_logprobs=ref,
                  kl_coef=0.05, entropy=ent, entropy_coef=0.01, max_response_tokens=7)

    def run(rows, **counts):
        x = logp.clone().requires_grad_()
        loss, metrics = policy_loss(x[rows], old[rows], adv[rows], mask[rows],
                                    **{**kwargs, "ref_logprobs": ref[rows], "entropy": ent[rows]}, **counts)
        loss.backward()
        return loss.detach(), metrics["pg_loss"], x.grad

    full_loss, full_pg, full_grad = run(slice(None))
    assert torch.isfinite(full_loss) and torch.isfinite(full_grad).all()
    counts = dict(num_tokens=int(mask.sum()), num_sequences=int(mask.any(-1).sum()))
    for size in (1, 2, 6):
        total, pg_total, grad_total = 0.0, 0.0, torch.zeros_like(logp)
        for start in range(0, 6, size):
            loss, pg, grad = run(slice(start, start + size), **counts)
            total, pg_total, grad_total = total + loss, pg_total + pg, grad_total + grad
        torch.testing.assert_close(total, full_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(pg_total, full_pg, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_total, full_grad, atol=1e-6, rtol=0)


def test_clip_high_positive_advantage_is_clipped():
    loss, metrics, grad = single_token(1.5, 1.0, **CLIP)
    assert loss == pytest.approx(-1.2)
    assert metrics["clip_fraction"].item() == 1.0 and grad == 0.0


def test_clip_low_negative_advantage_is_clipped():
    loss, metrics, grad = single_token(0.5, -1.0, **CLIP)
    assert loss == pytest.approx(0.8)
    assert metrics["clip_fraction"].item() == 1.0 and grad == 0.0


@pytest.mark.parametrize("ratio, adv", [(0.5, 1.0), (1.5, -1.0), (1.1, 2.0), (0.9, -2.0)])
def test_unclipped_side_keeps_gradient(ratio, adv):
    loss, metrics, grad = single_token(ratio, adv, **CLIP)
    assert loss == pytest.approx(-ratio * adv)
    assert grad == pytest.approx(-ratio * adv)  # d(-ratio·A)/dlogp = -ratio·A
    assert metrics["clip_fraction"].item() == 0.0


def test_clip_higher_is_asymmetric():
    kwargs = dict(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, metrics, _ = single_token(1.25, 1.0, **kwargs)
    assert loss == pytest.approx(-1.25) and metrics["clip_fraction"].item() == 0.0
    loss, metrics, _ = single_token(1.5, 1.0, **kwargs)
    assert loss == pytest.approx(-1.28) and metrics["clip_fraction"].item() == 1.0
    loss, metrics, _ = single_token(0.75, -1.0, **kwargs)
    assert loss == pytest.approx(0.8) and metrics["clip_fraction"].item() == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
    loss, _, grad = single_token(5.0, -1.0, **CLIP)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)
    loss, metrics, grad = single_token(5.0, -1.0, **CLIP, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert metrics["dual_clip_fraction"].item() == 1.0
    loss, metrics, _ = single_token(2.0, -0.5, **CLIP, dual_clip_c=3.0)  # 1.0 < 3·0.5: not active
    assert loss == pytest.approx(1.0) and metrics["dual_clip_fraction"].item() == 0.0
    loss, metrics, _ = single_token(5.0, 1.0, **CLIP, dual_clip_c=3.0)  # A > 0: untouched
    assert loss == pytest.approx(-1.2) and metrics["dual_clip_fraction"].item() == 0.0


def test_kl_entropy_and_tis_terms():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, float("nan")]])
    ent = torch.tensor([[0.4, 0.8, float("inf")]])
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([0.5])
    kl = kl_penalty(logp[:, :2], ref[:, :2], "k3")
    loss, metrics = policy_loss(logp, old, adv, mask, **CLIP, ref_logprobs=ref, kl_coef=0.1, entropy=ent,
                                entropy_coef=0.01)
    expected = (-0.5 + 0.1 * kl - 0.01 * torch.tensor([[0.4, 0.8]])).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(kl.mean().item(), abs=1e-6)
    assert metrics["entropy"].item() == pytest.approx(0.6, abs=1e-6)
    tis = torch.tensor([[0.5, 2.0, float("nan")]])
    loss, metrics = policy_loss(logp, old, adv, mask, **CLIP, tis_weights=tis)
    assert loss.item() == pytest.approx((-0.25 - 1.0) / 2, abs=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())
    assert "kl" not in metrics and "entropy" not in metrics and "dual_clip_fraction" not in metrics


def test_gradient_flows_only_through_logprobs_and_entropy():
    logp, old, ref, ent, adv, mask = random_batch(seed=3)
    leaves = {name: x.clone().requires_grad_() for name, x in
              dict(logp=logp, old=old, ref=ref, ent=ent, adv=adv, tis=torch.rand_like(logp)).items()}
    loss, metrics = policy_loss(leaves["logp"], leaves["old"], leaves["adv"], mask, **CLIP,
                                ref_logprobs=leaves["ref"], kl_coef=0.1, entropy=leaves["ent"], entropy_coef=0.01,
                                tis_weights=leaves["tis"])
    loss.backward()
    for name in ("old", "ref", "adv", "tis"):
        assert leaves[name].grad is None, name
    assert torch.isfinite(leaves["logp"].grad).all() and (leaves["logp"].grad[~mask] == 0).all()
    expected_ent_grad = torch.where(mask, -0.01 / mask.sum(), 0.0)
    torch.testing.assert_close(leaves["ent"].grad, expected_ent_grad)
    assert all(not m.requires_grad for m in metrics.values())


def test_nan_and_inf_under_mask_do_not_leak():
    logp, old, ref, ent, adv, mask = random_batch(seed=4)
    adv_tok = adv.unsqueeze(-1).expand_as(logp).clone()
    clean = {k: torch.where(mask, v, 0.0) for k, v in dict(logp=logp, old=old, ref=ref, ent=ent, adv=adv_tok).items()}
    dirty = dict(clean)
    for name, fill in (("logp", float("inf")), ("old", float("-inf")), ("ref", float("nan")), ("adv", float("nan"))):
        dirty[name] = torch.where(mask, clean[name], fill)

    def run(d):
        x = d["logp"].clone().requires_grad_()
        loss, metrics = policy_loss(x, d["old"], d["adv"], mask, **CLIP, ref_logprobs=d["ref"], kl_coef=0.1,
                                    entropy=d["ent"], entropy_coef=0.01)
        loss.backward()
        return loss, metrics, x.grad

    c_loss, c_metrics, c_grad = run(clean)
    d_loss, d_metrics, d_grad = run(dirty)
    assert torch.isfinite(d_loss) and torch.isfinite(d_grad).all()
    torch.testing.assert_close(d_loss, c_loss, atol=0, rtol=0)
    torch.testing.assert_close(d_grad, c_grad, atol=0, rtol=0)
    for k in c_metrics:
        torch.testing.assert_close(d_metrics[k], c_metrics[k], atol=0, rtol=0)


def test_token_advantages_equal_broadcast_sequence_advantages():
    logp, old, ref, ent, adv, mask = random_batch(seed=5)
    a, _ = policy_loss(logp, old, adv, mask, **CLIP)
    b, _ = policy_loss(logp, old, adv.unsqueeze(-1).expand_as(logp), mask, **CLIP)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_metrics_values():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 7.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, metrics = policy_loss(logp, torch.zeros(1, 4), torch.tensor([1.0]), mask, **CLIP)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["num_tokens_local"].item() == 3.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_eps_low=1.0), "clip_eps_low"),
        (dict(clip_eps_high=-0.1), "clip_eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(kl_coef=0.1), "needs ref_logprobs"),
        (dict(entropy_coef=0.1), "needs entropy"),
        (dict(loss_agg="seq-mean-token-sum-norm"), "requires max_response_tokens"),
        (dict(advantages=torch.zeros(3)), "advantages must have shape"),
        (dict(old_logprobs=torch.zeros(2, 3)), "old_logprobs must have shape"),
        (dict(response_mask=torch.ones(2, 5)), "response_mask must have shape"),
    ],
)
def test_validation(kwargs, match):
    args = dict(logprobs=torch.zeros(2, 4), old_logprobs=torch.zeros(2, 4), advantages=torch.zeros(2),
                response_mask=torch.ones(2, 4), **CLIP)
    with pytest.raises(ValueError, match=match):
        policy_loss(**(args | kwargs))


def test_log_ratio_is_clamped_before_exp():
    # logp − old = 1000 would overflow exp; it is clamped to 20, so the loss is exp(20)·|A| and finite.
    logp = torch.tensor([[0.0]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, metrics = policy_loss(logp, torch.tensor([[-1000.0]]), torch.tensor([-1.0]), mask, **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert torch.isfinite(logp.grad).all() and torch.isfinite(metrics["ratio_mean"])


def test_truncated_importance_weights_hand_values():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, -0.5, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_importance_weights(old, engine, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 0.0]]), atol=1e-6, rtol=0)
    w = truncated_importance_weights(old, engine, mask, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0]]), atol=1e-6, rtol=0)
    huge = truncated_importance_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.ones(1, 1), cap=2.0)
    assert huge.item() == 2.0
    with pytest.raises(ValueError, match="cap must be finite and > 0"):
        truncated_importance_weights(old, engine, mask, cap=0.0)


def test_nan_engine_logprob_gets_weight_one_and_the_update_goes_on():
    """Issue #12: engine logprobs [-0.5, NaN, -0.2] with tis_cap gave weight NaN and a NaN loss."""
    old = torch.tensor([[-0.5, -0.9, -0.2]])
    engine = torch.tensor([[-0.5, float("nan"), -0.2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = truncated_importance_weights(old, engine, mask, cap=2.0)
    assert w.tolist() == [[1.0, 1.0, 1.0]]
    logp = old.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, **CLIP, tis_weights=w, loss_agg="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -1.0 / 3))
    infinite = torch.tensor([[float("-inf"), float("inf"), -0.2]])
    assert truncated_importance_weights(old, infinite, mask, cap=2.0).tolist() == [[1.0, 1.0, 1.0]]
    assert truncated_importance_weights(old, engine, mask, cap=0.5).tolist() == [[0.5, 0.5, 0.5]]  # min(1, C)


def test_tis_weights_scale_each_tokens_policy_gradient_term():
    logp = torch.zeros(1, 2, requires_grad=True)
    w = truncated_importance_weights(torch.zeros(1, 2), torch.tensor([[0.0, -math.log(3.0)]]), torch.ones(1, 2), 2.0)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), **CLIP, tis_weights=w,
                          loss_agg="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0]]))
