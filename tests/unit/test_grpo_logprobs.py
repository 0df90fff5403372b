"""Unit tests for grpo.logprobs: tempered logprobs, chunking, dtypes, gradients, entropy."""

import math

import pytest
import torch

from grpo.logprobs import entropy_from_logits, logprobs_from_logits


def reference_logprobs(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_temperature_is_applied():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = logprobs_from_logits(logits, torch.tensor([0]), temperature=0.5)
    torch.testing.assert_close(out, torch.tensor([-0.14293]), atol=1e-5, rtol=0)
    untempered = logprobs_from_logits(logits, torch.tensor([0]))
    torch.testing.assert_close(untempered, torch.tensor([-0.40761]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_for_3d_inputs_any_chunk(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    out = logprobs_from_logits(logits, targets, temperature, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_logprobs(logits, targets, temperature), atol=1e-6, rtol=1e-6)


def test_gradient_matches_reference():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, 9, generator=gen)
    targets = torch.randint(0, 9, (4, 6), generator=gen)
    a = base.clone().requires_grad_()
    b = base.clone().requires_grad_()
    logprobs_from_logits(a, targets, 0.8, chunk_size=5).sum().backward()
    reference_logprobs(b, targets, 0.8).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_bf16_logits_give_float32_and_large_logits_are_stable():
    expected = torch.tensor([-math.log1p(math.exp(-1.0))])
    bf16 = torch.tensor([[128.0, 127.0, 0.0]]).to(torch.bfloat16)  # exactly representable in bf16
    out = logprobs_from_logits(bf16, torch.tensor([0]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)  # float32 ulp at 128 is 1.5e-5
    big = torch.tensor([[1e4, 1e4 - 1.0, -1e4]])  # no overflow; float32 ulp at 1e4 is 1e-3
    torch.testing.assert_close(logprobs_from_logits(big, torch.tensor([0])), expected, atol=2e-3, rtol=0)


def test_validation():
    with pytest.raises(ValueError, match="leading shape"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.zeros(2, 5), temperature=-1.0)


def test_entropy_uniform_and_reference():
    assert entropy_from_logits(torch.zeros(2, 3, 8)).sub(math.log(8)).abs().max() < 1e-6
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 7, generator=gen) * 3
    for temperature in (1.0, 0.6):
        p = torch.softmax(logits / temperature, -1)
        expected = -(p * p.log()).sum(-1)
        for chunk in (None, 2):
            out = entropy_from_logits(logits, temperature, chunk_size=chunk)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_entropy_with_masked_vocabulary_is_finite_with_finite_grad():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([math.log(2)]))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
