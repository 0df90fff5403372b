"""Token log-probabilities and entropies from logits, without materialising a full log-softmax.

Shapes:
    M   flattened leading positions (e.g. N·T), V vocabulary size

log p(y) = z_y − logsumexp(z) with z = logits / temperature, computed in float32 (bf16/fp16 logits are upcast one
chunk at a time). `chunk_size` bounds the float32 working copy to chunk_size × V elements; the result is the same
for every chunk size.

The temperature must be the one the rollout sampled with: the behaviour logprobs of tokens sampled at temperature τ
are log softmax(logits / τ), so the policy logprobs compared with them in the importance ratio must use τ too.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "logprobs_from_logits"]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _chunks(n: int, chunk_size: int | None) -> list[slice]:
    if chunk_size is None:
        return [slice(0, n)]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size!r}")
    return [slice(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)] or [slice(0, 0)]


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at the target tokens.

    Args:
        logits: [..., V] float (float32/bf16/fp16), e.g. [M, V] or [N, T, V]; unnormalised scores.
        targets: [...] int64 token ids in [0, V), same leading shape as `logits`.
        temperature: > 0, the sampling temperature τ.
        chunk_size: if set, process at most this many leading positions at a time (memory bound chunk_size × V
            float32); None processes everything at once.

    Returns:
        [...] float32, natural-log probabilities (≤ 0), differentiable w.r.t. `logits`.

    Raises:
        ValueError: shape mismatch, non-integer targets, temperature ≤ 0, chunk_size < 1.
    """
    _check_temperature(temperature)
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have the leading shape of logits {tuple(logits.shape[:-1])} (logits {tuple(logits.shape)}),"
            f" got {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).to(torch.int64)
    out = []
    for s in _chunks(flat_logits.shape[0], chunk_size):
        z = flat_logits[s].float()
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, flat_targets[s].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(out).reshape(targets.shape)


def entropy_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy H = −Σ p·log p of softmax(z) over the last dim, with z = logits / temperature.

    Args:
        logits: [..., V] float; −inf entries (masked vocabulary) are allowed and contribute 0.
        temperature: > 0.
        chunk_size: as in `logprobs_from_logits`.

    Returns:
        [...] float32 entropies in nats (≥ 0 up to rounding), differentiable w.r.t. `logits`.
    """
    _check_temperature(temperature)
    if logits.dim() < 1:
        raise ValueError(f"logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = []
    for s in _chunks(flat.shape[0], chunk_size):
        z = flat[s].float()
        if temperature != 1.0:
            z = z / temperature
        z = z.clamp(min=torch.finfo(z.dtype).min)
        logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])
