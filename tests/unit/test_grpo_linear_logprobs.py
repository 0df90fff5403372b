"""grpo.logprobs.linear_logprobs (LM head fused with the log-softmax, chunked) equals the unfused computation:
``logprobs_from_logits(linear(h, W, b))`` and ``entropy_from_logits`` — values and gradients w.r.t. h, W, b, of the
logprobs and of the entropies (an entropy bonus trains the policy through the fused head) — for one chunk (softmax
kept) and several chunks (logits recomputed in backward), with and without temperature and sampling filters."""

import pytest
import torch

from grpo.logprobs import entropy_from_logits, filter_logits_, linear_logprobs, logprobs_from_logits

M, H, V = 13, 8, 50


def _inputs(seed: int, with_bias: bool):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=gen, dtype=torch.float64).float() * 2
    weight = torch.randn(V, H, generator=gen) * 0.7
    bias = torch.randn(V, generator=gen) if with_bias else None
    targets = torch.randint(0, V, (M,), generator=gen)
    upstream = torch.randn(M, generator=gen)  # a non-uniform incoming gradient (like the per-token loss weights)
    return hidden, weight, bias, targets, upstream


def _leaves(*tensors):
    return [t.clone().requires_grad_() if t is not None else None for t in tensors]


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 13, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_unfused(chunk_size, temperature, with_bias):
    hidden, weight, bias, targets, upstream = _inputs(0, with_bias)
    h1, w1, b1 = _leaves(hidden, weight, bias)
    lp, ent = linear_logprobs(h1, w1, targets, temperature, bias=b1, chunk_size=chunk_size, with_entropy=True)
    (lp * upstream).sum().backward()

    h2, w2, b2 = _leaves(hidden, weight, bias)
    logits = torch.nn.functional.linear(h2, w2, b2)
    lp_ref = logprobs_from_logits(logits, targets, temperature)
    (lp_ref * upstream).sum().backward()
    ent_ref = entropy_from_logits(logits.detach(), temperature)

    assert lp.dtype == torch.float32 and lp.shape == (M,)
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)
    if with_bias:
        torch.testing.assert_close(b1.grad, b2.grad, atol=1e-5, rtol=1e-5)


FILTERS = [{}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.05, "top_k": 20}]


def _unfused_entropy(logits, targets, temperature, filters):
    """Entropy of the sampling distribution from full logits, differentiable; the kept set fixed (as the fused
    backward treats it)."""
    z = logits / temperature
    with torch.no_grad():
        removed = torch.isneginf(filter_logits_(z.detach().float().clone(), targets, **filters))
    return entropy_from_logits(z.masked_fill(removed, float("-inf")))


@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("temperature, with_bias", [(1.0, False), (0.6, True)])
def test_entropy_gradient_matches_unfused(filters, chunk_size, temperature, with_bias):
    """A loss of both outputs, Σ u·logp − Σ v·H (the policy loss with an entropy bonus), and of the entropies alone:
    the fused head's gradients equal those through the full logits (entropy_from_logits of the filtered logits)."""
    hidden, weight, bias, targets, upstream = _inputs(4, with_bias)
    v = torch.rand(M, generator=torch.Generator().manual_seed(5)) + 0.5
    for use_logprobs in (True, False):
        h1, w1, b1 = _leaves(hidden, weight, bias)
        lp, ent = linear_logprobs(h1, w1, targets, temperature, bias=b1, chunk_size=chunk_size, with_entropy=True,
                                  **filters)
        assert ent.requires_grad
        ((lp * upstream).sum() * use_logprobs - (ent * v).sum()).backward()

        h2, w2, b2 = _leaves(hidden, weight, bias)
        logits = torch.nn.functional.linear(h2, w2, b2)
        lp_ref = logprobs_from_logits(logits, targets, temperature, **filters)
        ent_ref = _unfused_entropy(logits, targets, temperature, filters)
        ((lp_ref * upstream).sum() * use_logprobs - (ent_ref * v).sum()).backward()

        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
        assert w2.grad.abs().max() > 1e-2
        for got, ref in ((h1.grad, h2.grad), (w1.grad, w2.grad)) + (((b1.grad, b2.grad),) if with_bias else ()):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("filters", FILTERS[:2], ids=[str(f) for f in FILTERS[:2]])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_entropy_gradcheck_float64(filters, chunk_size):
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=gen)

    def f(h, w):
        lp, ent = linear_logprobs(h, w, targets, 0.9, chunk_size=chunk_size, with_entropy=True, **filters)
        assert ent.requires_grad  # gradcheck skips an output without a graph
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_a_retained_graph_gives_the_same_entropy_gradient_twice():
    """One chunk keeps its log-softmax for the first backward (consumed in place); a second backward recomputes."""
    hidden, weight, _, targets, _ = _inputs(7, False)
    h = hidden.clone().requires_grad_()
    lp, ent = linear_logprobs(h, weight, targets, with_entropy=True)
    loss = lp.sum() - 0.1 * ent.sum()
    (first,) = torch.autograd.grad(loss, h, retain_graph=True)
    (second,) = torch.autograd.grad(loss, h)
    torch.testing.assert_close(first, second, atol=1e-6, rtol=1e-6)


def test_gradcheck_float64_several_chunks():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=gen)

    def f(h, w):
        return linear_logprobs(h, w, targets, 0.9, chunk_size=2)[0].double()

    # float32 inside: loose tolerances, but a wrong formula (sign, missing 1/τ, onehot) fails by O(1)
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_without_entropy_returns_none_and_validation():
    hidden, weight, _, targets, _ = _inputs(1, False)
    lp, ent = linear_logprobs(hidden, weight, targets, chunk_size=4)
    assert ent is None and lp.shape == (M,)
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="integer"):
        linear_logprobs(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(hidden, weight, targets, chunk_size=0)
