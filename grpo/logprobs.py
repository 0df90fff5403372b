"""Token log-probabilities and entropies from logits, without materialising a full log-softmax.

Shapes:
    M   flattened leading positions (e.g. N·T), V vocabulary size

log p(y) = z_y − logsumexp(z) with z = logits / temperature, computed in float32 (bf16/fp16 logits are upcast one
chunk at a time). `chunk_size` bounds the float32 working copy to chunk_size × V elements; the result is the same
for every chunk size.

The temperature must be the one the rollout sampled with: the behaviour logprobs of tokens sampled at temperature τ
are log softmax(logits / τ), so the policy logprobs compared with them in the importance ratio must use τ too.

`linear_logprobs` fuses the LM head with the log-softmax (the "fused linear cross-entropy" of Liger-Kernel and
Cut Cross-Entropy, Wijmans et al. 2024): it never holds more than chunk_size × V logits, for the forward and the
backward, at the price of recomputing each chunk's logits in the backward when there is more than one chunk.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "linear_logprobs", "logprobs_from_logits"]


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


class _LinearLogprobs(torch.autograd.Function):
    """Autograd of :func:`linear_logprobs`. Saves the hidden states, the head weight and each position's logsumexp;
    with one chunk also its softmax (no recompute), with several chunks recomputes each chunk's logits in backward.

    d logp_i / d z_ij = 1[j = y_i] − p_ij and z = (h Wᵀ + b) / τ, so with g_i the incoming gradient:
    dz = g ⊙ (onehot − p) / τ, dh = dz W, dW = dzᵀ h, db = Σ_i dz_i.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):
        m = hidden.shape[0]
        chunks = _chunks(m, chunk_size)
        logprobs = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m, dtype=torch.float32, device=hidden.device) if with_entropy else None
        probs = None
        for s in chunks:
            z = _chunk_logits(hidden[s], weight, bias, temperature)
            lse[s] = torch.logsumexp(z, dim=-1)
            logprobs[s] = z.gather(-1, targets[s].unsqueeze(-1)).squeeze(-1) - lse[s]
            if with_entropy or len(chunks) == 1:
                logp = z.sub_(lse[s].unsqueeze(-1))  # z is not needed again
                p = logp.exp()
                if with_entropy:
                    entropy[s] = -(p * logp).sum(-1)
                if len(chunks) == 1:
                    probs = p
        ctx.temperature, ctx.chunk_size, ctx.has_bias = temperature, chunk_size, bias is not None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, probs)
        if entropy is None:
            return logprobs, None
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, targets, lse, probs = ctx.saved_tensors
        tau = ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        g = grad_logprobs.float()
        for s in _chunks(hidden.shape[0], ctx.chunk_size):
            if probs is not None:
                p = probs
            else:
                p = (_chunk_logits(hidden[s], weight, bias, tau) - lse[s].unsqueeze(-1)).exp_()
            dz = p.mul_(-g[s].unsqueeze(-1))  # in place: p is not needed again
            dz.scatter_add_(-1, targets[s].unsqueeze(-1), g[s].unsqueeze(-1))
            if tau != 1.0:
                dz.div_(tau)
            dz = dz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s] = dz @ weight
            if grad_weight is not None:
                grad_weight += (dz.t() @ hidden[s]).float()
            if grad_bias is not None:
                grad_bias += dz.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z / temperature if temperature != 1.0 else z


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of ``targets`` (and entropies) under softmax((hidden Wᵀ + b) / τ), without materialising [M, V].

    Equal, within float32 rounding, to ``logprobs_from_logits(linear(hidden, weight, bias), targets, τ)`` and
    ``entropy_from_logits`` of the same logits, in value and in gradient (w.r.t. ``hidden``, ``weight``, ``bias``).

    Args:
        hidden: [M, H] float, the final hidden states at the M positions that predict ``targets``.
        weight: [V, H] the LM head (same dtype as ``hidden``); bias: [V] or None.
        targets: [M] int64 token ids in [0, V).
        temperature: > 0, the sampling temperature τ.
        chunk_size: positions per chunk; at most chunk_size × V float32 logits exist at once (forward and backward).
            None or chunk_size ≥ M: one chunk, whose softmax is kept for the backward (no recompute). With several
            chunks the backward recomputes each chunk's logits: + 2·M·H·V FLOPs.
        with_entropy: also return the entropies H = −Σ p·log p [M] float32 (not differentiable).

    Returns:
        (logprobs [M] float32, differentiable; entropy [M] float32 detached, or None).

    Raises:
        ValueError: shapes that do not match, non-integer targets, temperature ≤ 0, chunk_size < 1.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [M, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape [M] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape [V] = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    _chunks(1, chunk_size)  # validates chunk_size
    if chunk_size is not None and chunk_size >= hidden.shape[0]:
        chunk_size = None
    return _LinearLogprobs.apply(hidden, weight, bias, targets.to(torch.int64), float(temperature), chunk_size,
                                 with_entropy)
