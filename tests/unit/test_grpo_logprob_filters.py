"""Sampling filters in grpo.logprobs (top-k, top-p, min-p): the trainer's logprobs describe the distribution vLLM
samples from and reports as processed logprobs — temperature, then min-p, top-k, top-p, renormalised over the kept
set, with the target token always kept. Checked against hand-computed values, a brute-force float64 reference,
vLLM 0.32's own top-k/top-p function, and torch.autograd.gradcheck of the fused chunked LM-head function."""

import math

import pytest
import torch

from grpo.logprobs import filter_logits_, linear_logprobs, logprobs_from_logits

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([PROBS]).log()  # softmax(LOGITS) == PROBS


def _lp(target: int, **filters) -> float:
    return logprobs_from_logits(LOGITS, torch.tensor([target]), **filters).item()


@pytest.mark.parametrize(("filters", "target", "expected"), [
    # top-p 0.9: ascending cumulative mass 0.05, 0.2, 0.5, 1.0; <= 0.1 removed -> {0.5, 0.3, 0.15} kept, mass 0.95
    ({"top_p": 0.9}, 0, math.log(0.5 / 0.95)),
    ({"top_p": 0.9}, 2, math.log(0.15 / 0.95)),
    # the removed token as target is put back: K = all four
    ({"top_p": 0.9}, 3, math.log(0.05)),
    # top-k 2: {0.5, 0.3}; target 2 put back -> {0.5, 0.3, 0.15}
    ({"top_k": 2}, 0, math.log(0.5 / 0.8)),
    ({"top_k": 2}, 2, math.log(0.15 / 0.95)),
    # min-p 0.4: threshold 0.4 * 0.5 = 0.2 -> {0.5, 0.3}
    ({"min_p": 0.4}, 1, math.log(0.3 / 0.8)),
    # top-k 3 then top-p 0.7 over the renormalised {0.526, 0.316, 0.158}: cumulative 0.158 <= 0.3 removed -> {0, 1}
    ({"top_k": 3, "top_p": 0.7}, 0, math.log(0.5 / 0.8)),
    # min-p 0.2 (threshold 0.1 removes 0.05) then top-p 0.8 over {0.526, 0.316, 0.158}: 0.158 <= 0.2 removed
    ({"min_p": 0.2, "top_p": 0.8}, 1, math.log(0.3 / 0.8)),
    # off: 0 and -1 (vLLM's "off"), k >= V
    ({"top_k": 0}, 0, math.log(0.5)),
    ({"top_k": -1}, 0, math.log(0.5)),
    ({"top_k": 4}, 0, math.log(0.5)),
])
def test_hand_computed_values(filters, target, expected):
    assert _lp(target, **filters) == pytest.approx(expected, abs=1e-6)


def test_temperature_is_applied_before_the_filters():
    # tau 0.5 squares the odds: probs ∝ 0.25, 0.09, 0.0225, 0.0025 (sum 0.365) -> 0.685, 0.247, 0.062, 0.007;
    # top-p 0.9: ascending cumulative 0.007, 0.068, 0.315 -> the two smallest removed, K = {0, 1}
    out = logprobs_from_logits(LOGITS, torch.tensor([0]), 0.5, top_p=0.9).item()
    assert out == pytest.approx(math.log(0.25 / 0.34), abs=1e-6)


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    out = logprobs_from_logits(logits, torch.tensor([0]), top_k=2).item()
    assert out == pytest.approx(2.0 - math.log(math.exp(2) + 2 * math.exp(1)), abs=1e-6)


def _brute_force(row: list[float], target: int, tau: float, top_k: int, top_p: float, min_p: float) -> float:
    """Float64, one row, lists only: the kept set by the definitions in vLLM's sampler, then the target added."""
    z = [x / tau for x in row]
    v = len(z)
    keep = set(range(v))
    if min_p > 0:
        e = [math.exp(x - max(z)) for x in z]
        p = [x / sum(e) for x in e]
        keep = {j for j in keep if p[j] >= min_p * max(p)}
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {j for j in keep if z[j] >= kth}
    if top_p < 1:
        mass = sum(math.exp(z[j]) for j in keep)
        ascending = sorted(keep, key=lambda j: z[j])
        cumulative = 0.0
        for j in ascending[:-1]:
            cumulative += math.exp(z[j]) / mass
            if cumulative <= 1 - top_p:
                keep.discard(j)
    keep.add(target)
    return z[target] - math.log(sum(math.exp(z[j]) for j in keep))


@pytest.mark.parametrize(("tau", "top_k", "top_p", "min_p"), [
    (1.0, 0, 0.9, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (0.9, 12, 0.8, 0.02), (1.0, 3, 0.5, 0.3),
])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_matches_brute_force(tau, top_k, top_p, min_p, chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 40, generator=gen) * 2.5
    targets = torch.randint(0, 40, (9,), generator=gen)
    out = logprobs_from_logits(logits, targets, tau, chunk_size=chunk_size, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = [_brute_force(logits[i].double().tolist(), int(targets[i]), tau, top_k, top_p, min_p) for i in range(9)]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32), atol=2e-5, rtol=0)
    unfiltered = logprobs_from_logits(logits, targets, tau)
    assert (out - unfiltered).abs().max() > 1e-3  # the filters removed mass on these rows


def test_same_as_vllm_top_k_top_p():
    """vLLM's processed logprobs for top-k/top-p are log_softmax(apply_top_k_top_p_pytorch(z, k, p)); at tokens the
    engine can sample (its kept set) ours are the same."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(6, 300, generator=gen) * 3
    for k, p in ((None, 0.9), (20, None), (50, 0.7), (7, 0.95)):
        k_t = None if k is None else torch.full((6,), k, dtype=torch.long)
        p_t = None if p is None else torch.full((6,), p, dtype=torch.float32)
        vllm_lp = sampler.apply_top_k_top_p_pytorch(z.clone(), k_t, p_t, allow_cpu_sync=True).log_softmax(-1)
        ours = filter_logits_(z.clone(), None, top_k=k or 0, top_p=p or 1.0)
        assert torch.equal(torch.isneginf(ours), torch.isneginf(vllm_lp)), (k, p)
        sampled = vllm_lp.argmax(-1)  # any kept token
        mine = logprobs_from_logits(z, sampled, top_k=k or 0, top_p=p or 1.0)
        torch.testing.assert_close(mine, vllm_lp.gather(-1, sampled[:, None])[:, 0], atol=1e-6, rtol=0)


def test_target_outside_the_kept_set_stays_finite():
    logits = torch.tensor([[10.0, 0.0, -30.0]])
    out = logprobs_from_logits(logits, torch.tensor([2]), top_k=1).item()
    assert out == pytest.approx(-40.0 - math.log1p(math.exp(-40.0)), abs=1e-5)


@pytest.mark.parametrize("bad", [{"top_k": -2}, {"top_k": 1.5}, {"top_k": True}, {"top_p": 0.0}, {"top_p": 1.1},
                                 {"top_p": math.nan}, {"min_p": 1.0}, {"min_p": -0.1}])
def test_out_of_range_filters_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        logprobs_from_logits(LOGITS, torch.tensor([0]), **bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        linear_logprobs(torch.ones(1, 1), torch.ones(4, 1), torch.tensor([0]), **bad)
    # the public in-place filter too: top_k=True filtered as k=1, top_p=0 kept only the largest, top_p=1.1 nothing
    with pytest.raises(ValueError, match=next(iter(bad))):
        filter_logits_(LOGITS.clone(), None, **bad)


M, H, V = 11, 6, 30


def _fused_inputs(dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(M, H, generator=gen, dtype=torch.float64) * 2).to(dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.8).to(dtype)
    bias = torch.randn(V, generator=gen, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, V, (M,), generator=gen)
    upstream = torch.randn(M, generator=gen, dtype=torch.float64).to(dtype)
    return hidden, weight, bias, targets, upstream


FILTERS = [{"top_p": 0.9}, {"top_k": 4}, {"min_p": 0.1}, {"top_k": 8, "top_p": 0.8, "min_p": 0.05}]


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_fused_matches_unfused_values_and_gradients(filters, chunk_size):
    hidden, weight, bias, targets, upstream = _fused_inputs()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = linear_logprobs(leaves[0], leaves[1], targets, 0.8, bias=leaves[2], chunk_size=chunk_size,
                              with_entropy=True, **filters)
    (lp * upstream).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(ref_leaves[0], ref_leaves[1], ref_leaves[2])
    ref = logprobs_from_logits(logits, targets, 0.8, **filters)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)
    # entropy of the filtered distribution (targets kept): finite, and below the unfiltered one
    z = filter_logits_(logits.detach() / 0.8, targets, **filters)
    logp = z.log_softmax(-1)
    expected_ent = -torch.where(torch.isneginf(z), 0.0, logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent, expected_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_fused_gradcheck_float64(filters, chunk_size):
    hidden, weight, bias, targets, _ = _fused_inputs(torch.float64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    # the kept set must not move under gradcheck's 1e-6 perturbations: it holds for these inputs, and the check
    # below makes the test fail loudly (not pass vacuously) if the filters remove nothing
    lp, _ = linear_logprobs(*leaves[:2], targets, 0.8, bias=leaves[2], **filters)
    assert (lp - linear_logprobs(*leaves[:2], targets, 0.8, bias=leaves[2])[0]).abs().max() > 1e-3
    assert torch.autograd.gradcheck(
        lambda h, w, b: linear_logprobs(h, w, targets, 0.8, bias=b, chunk_size=chunk_size, **filters)[0],
        tuple(leaves), eps=1e-6, atol=1e-7)


def test_no_filter_means_the_unfiltered_path():
    hidden, weight, bias, targets, _ = _fused_inputs()
    base, _ = linear_logprobs(hidden, weight, targets, bias=bias)
    for off in ({"top_k": 0}, {"top_k": -1}, {"top_k": V}, {"top_p": 1.0}, {"min_p": 0.0}):
        torch.testing.assert_close(linear_logprobs(hidden, weight, targets, bias=bias, **off)[0], base, atol=0,
                                   rtol=0)
