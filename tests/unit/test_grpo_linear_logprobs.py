"""grpo.logprobs.linear_logprobs (LM head fused with the log-softmax, chunked) equals the unfused computation:
``logprobs_from_logits(linear(h, W, b))`` and ``entropy_from_logits`` — values and gradients w.r.t. h, W, b — for one
chunk (softmax kept) and several chunks (logits recomputed in backward), with and without temperature."""

import pytest
import torch

from grpo.logprobs import entropy_from_logits, linear_logprobs, logprobs_from_logits

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

    assert lp.dtype == torch.float32 and lp.shape == (M,) and not ent.requires_grad
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)
    if with_bias:
        torch.testing.assert_close(b1.grad, b2.grad, atol=1e-5, rtol=1e-5)


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
