"""Token log-probabilities and entropies from logits, without materialising a full log-softmax.

Shapes:
    M   flattened leading positions (e.g. N·T), V vocabulary size

log p(y) = z_y − logsumexp(z) with z = logits / temperature, computed in float32 (bf16/fp16 logits are upcast one
chunk at a time; float64 inputs stay float64, for gradient checks). `chunk_size` bounds the float32 working copy to
chunk_size × V elements; the result is the same for every chunk size.

The temperature must be the one the rollout sampled with: the behaviour logprobs of tokens sampled at temperature τ
are log softmax(logits / τ), so the policy logprobs compared with them in the importance ratio must use τ too.

Sampling filters (top-k, top-p, min-p). The rollout engine returns vLLM's *processed* logprobs: the logprob of the
sampled token under the distribution it was sampled from, i.e. after temperature AND the filters, renormalised over
the tokens they keep. With ``top_k``/``top_p``/``min_p`` set, every function here computes that same distribution
(see `filter_logits_`), so the importance ratio and the truncated-IS weights compare like with like:

    z = logits / τ;  K = kept set of z (vLLM 0.32's sampler order: min-p, then top-k, then top-p) ∪ {target};
    log p(y) = z_y − logsumexp_{j ∈ K} z_j

The target token is always added to K, so the logprob stays finite when the policy has moved since sampling
(several iterations per batch, the reference policy): a token the engine sampled was in the engine's kept set, and
for identical weights K equals it. Gradients treat K as fixed (it is piecewise constant in the logits).

`linear_logprobs` fuses the LM head with the log-softmax (the "fused linear cross-entropy" of Liger-Kernel and
Cut Cross-Entropy, Wijmans et al. 2024): it never holds more than chunk_size × V logits, for the forward and the
backward, at the price of recomputing each chunk's logits in the backward when there is more than one chunk.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "filter_logits_", "linear_logprobs", "logprobs_from_logits"]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 compute copy (float64 stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _check_filters(top_k: int, top_p: float, min_p: float) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p!r}")


def _filtering(vocab: int, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether any filter changes the distribution (top_k >= V keeps everything, as in vLLM)."""
    return 0 < top_k < vocab or top_p < 1.0 or min_p > 0.0


def filter_logits_(
    z: torch.Tensor,
    targets: torch.Tensor | None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Set to −inf, in place, the temperature-scaled logits that vLLM's sampler removes, except each row's target.

    Follows vLLM 0.32 (``vllm/v1/sample``): ``Sampler.sample`` applies the temperature, then the argmax-invariant
    logits processors (``MinPLogitsProcessor``), then ``TopKTopPSampler`` (``apply_top_k_top_p_pytorch``, the CPU
    and PyTorch-native path: top-k, then top-p), and its ``processed_logprobs`` are the log-softmax of the result.

    - min-p: p = softmax(z); remove j where p_j < min_p · max(p).
    - top-k: remove j where z_j < (k-th largest z); ties with the k-th value are kept (so more than k may remain).
    - top-p: over the tokens left, sorted ascending, remove those whose cumulative softmax mass is <= 1 − top_p; the
      largest token is always kept. Tokens tied at the boundary are split by the sort order, as in vLLM; exact ties
      of float logits at the boundary are the only case where this and the engine may differ (and vLLM's Triton
      and FlashInfer GPU kernels use their own tie and rounding rules).
    - ``targets`` (if given) are put back in the kept set afterwards.

    Args:
        z: [M, V] float32 logits already divided by the temperature; modified in place.
        targets: [M] int64 or None.
        top_k: keep the k largest; 0 or -1 (vLLM's "off") keeps all, as does k >= V.
        top_p: nucleus mass in (0, 1]; 1 keeps all.
        min_p: in [0, 1); 0 keeps all.

    Returns:
        ``z`` (the same tensor), removed entries −inf.

    Raises:
        ValueError: a filter out of range (top_k not an int >= -1, top_p outside (0, 1], min_p outside [0, 1)).
    """
    _check_filters(top_k, top_p, min_p)
    vocab = z.shape[-1]
    if not _filtering(vocab, top_k, top_p, min_p):
        return z
    picked = z.gather(-1, targets.unsqueeze(-1)) if targets is not None else None
    if min_p > 0.0:  # MinPLogitsProcessor.apply
        probs = torch.softmax(z, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(torch.tensor(min_p, dtype=torch.float32))
        z.masked_fill_(probs < threshold, float("-inf"))
        del probs, threshold
    if 0 < top_k < vocab:  # apply_top_k_top_p_pytorch: top-k first, on the min-p-filtered logits
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z.masked_fill_(z < kth, float("-inf"))
    if top_p < 1.0:  # then top-p over what top-k left
        z_sorted, order = z.sort(dim=-1, descending=False)
        cumulative = z_sorted.softmax(dim=-1).cumsum_(dim=-1)
        del z_sorted
        remove_sorted = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
        remove_sorted[..., -1] = False
        z.masked_fill_(torch.empty_like(remove_sorted).scatter_(-1, order, remove_sorted), float("-inf"))
    if picked is not None:
        z.scatter_(-1, targets.unsqueeze(-1), picked)
    return z


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
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at the target tokens, renormalised over the sampling filters' kept
    set plus the target when ``top_k``/``top_p``/``min_p`` are set (module docstring, `filter_logits_`).

    Args:
        logits: [..., V] float (float32/bf16/fp16), e.g. [M, V] or [N, T, V]; unnormalised scores.
        targets: [...] int64 token ids in [0, V), same leading shape as `logits`.
        temperature: > 0, the sampling temperature τ.
        chunk_size: if set, process at most this many leading positions at a time (memory bound chunk_size × V
            float32); None processes everything at once.
        top_k, top_p, min_p: the rollout's sampling filters (vLLM semantics, see `filter_logits_`); defaults: off.

    Returns:
        [...] float32, natural-log probabilities (≤ 0), differentiable w.r.t. `logits`.

    Raises:
        ValueError: shape mismatch, non-integer targets, temperature ≤ 0, chunk_size < 1, a filter out of range.
    """
    _check_temperature(temperature)
    _check_filters(top_k, top_p, min_p)
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
    filtering = _filtering(vocab, top_k, top_p, min_p)
    out = []
    for s in _chunks(flat_logits.shape[0], chunk_size):
        z = _upcast(flat_logits[s])
        if temperature != 1.0:
            z = z / temperature
        if filtering:
            with torch.no_grad():
                removed = torch.isneginf(filter_logits_(z.detach().clone(), flat_targets[s], top_k, top_p, min_p))
            z = z.masked_fill(removed, float("-inf"))
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
        [...] float32 entropies in nats (≥ 0 up to rounding), differentiable w.r.t. `logits`; a −inf logit gets
        gradient 0 (its p · log p term is formed with log p floored at −1e4, where p is exactly 0, so no 0 · ∞ enters
        the backward whatever the incoming gradient).
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
        out.append(_entropy_of(z - torch.logsumexp(z, dim=-1, keepdim=True)))
    return torch.cat(out).reshape(logits.shape[:-1])


class _LinearLogprobs(torch.autograd.Function):
    """Autograd of :func:`linear_logprobs`. Saves the hidden states, the head weight and each position's logsumexp
    (and entropy); with one chunk also its softmax, or its log-softmax when entropies are returned (no recompute),
    with several chunks recomputes each chunk's logits in backward.

    With z = (h Wᵀ + b) / τ, p = softmax(z), incoming gradients g (logprobs) and e (entropies):
    d logp_i / d z_ij = 1[j = y_i] − p_ij and d H_i / d z_ij = −p_ij (log p_ij + H_i), so
    dz = g ⊙ (onehot − p) − e ⊙ p ⊙ (log p + H), all divided by τ; dh = dz W, dW = dzᵀ h, db = Σ_i dz_i. With sampling
    filters, p is the softmax renormalised over the kept set (0 outside it), which the backward recomputes per chunk
    like the logits. An output the loss does not use gets no gradient term (``set_materialize_grads(False)``): without
    an entropy term the backward is the logprobs-only one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, filters):
        ctx.set_materialize_grads(False)
        m = hidden.shape[0]
        chunks = _chunks(m, chunk_size)
        dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprobs = torch.empty(m, dtype=dt, device=hidden.device)
        lse = torch.empty(m, dtype=dt, device=hidden.device)
        entropy = torch.empty(m, dtype=dt, device=hidden.device) if with_entropy else None
        kept = None
        for s in chunks:
            z = _chunk_logits(hidden[s], weight, bias, temperature, targets[s], filters)
            lse[s] = torch.logsumexp(z, dim=-1)
            logprobs[s] = z.gather(-1, targets[s].unsqueeze(-1)).squeeze(-1) - lse[s]
            if with_entropy or len(chunks) == 1:
                logp = z.sub_(lse[s].unsqueeze(-1))  # z is not needed again
                if with_entropy:
                    entropy[s] = _entropy_of(logp)
                if len(chunks) == 1:
                    kept = logp if with_entropy else logp.exp_()
        ctx.temperature, ctx.chunk_size, ctx.has_bias = temperature, chunk_size, bias is not None
        ctx.filters = filters
        # an intermediate, kept on ctx (not saved): the first backward consumes it in place, a repeated backward
        # (retain_graph, gradcheck) recomputes it like the chunked path. The softmax, or with entropies the
        # log-softmax (the entropy's gradient needs both).
        ctx.kept, ctx.kept_is_log = kept, with_entropy
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        tau = ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = lse.dtype  # float32 (float64 for float64 inputs)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        g = None if grad_logprobs is None else grad_logprobs.to(acc)
        e = None if grad_entropy is None else grad_entropy.to(acc)
        for s in _chunks(hidden.shape[0], ctx.chunk_size):
            if kept is not None:
                logp_or_p, is_log = kept, ctx.kept_is_log
            else:
                logp_or_p = _chunk_logits(hidden[s], weight, bias, tau, targets[s], ctx.filters)
                logp_or_p, is_log = logp_or_p.sub_(lse[s].unsqueeze(-1)), True
            dz = _logit_grad(logp_or_p, is_log, targets[s], None if g is None else g[s],
                             None if e is None else e[s], None if e is None else entropy[s])
            if tau != 1.0:
                dz.div_(tau)
            dz = dz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s] = dz @ weight
            if grad_weight is not None:
                grad_weight += (dz.t() @ hidden[s]).to(acc)
            if grad_bias is not None:
                grad_bias += dz.to(acc).sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


#: Log-probabilities below this are probabilities of exactly 0 in float32 and float64 (exp(−1e4) underflows both),
#: so clamping to it changes no p · log p term while keeping −inf (filtered tokens) out of the products.
_LOG_FLOOR = -1e4


def _entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """Entropies [c] of rows of log-probabilities [c, V] (−inf allowed: a removed token adds 0)."""
    return -(logp.exp() * logp.clamp(min=_LOG_FLOOR)).sum(-1)


def _logit_grad(logp_or_p: torch.Tensor, is_log: bool, targets: torch.Tensor, g: torch.Tensor | None,
                e: torch.Tensor | None, entropy: torch.Tensor | None) -> torch.Tensor:
    """d loss / d z of one chunk (before the 1/τ), consuming ``logp_or_p`` [c, V] in place: g ⊙ (onehot − p) from the
    logprobs' gradient g [c] and −e ⊙ p ⊙ (log p + H) from the entropies' gradient e [c] (either may be None)."""
    if e is None:
        p = logp_or_p.exp_() if is_log else logp_or_p
        dz = p.mul_(-g.unsqueeze(-1)) if g is not None else p.zero_()
    else:
        p = logp_or_p.exp()
        dz = logp_or_p.clamp_(min=_LOG_FLOOR).add_(entropy.unsqueeze(-1)).mul_(e.unsqueeze(-1))
        if g is not None:
            dz.add_(g.unsqueeze(-1))
        dz.mul_(p).neg_()
    if g is not None:
        dz.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
    return dz


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                  targets: torch.Tensor, filters: tuple[int, float, float] | None) -> torch.Tensor:
    """[c, V] float32 (float64 for float64 inputs) logits / τ of one chunk, the filters' removed tokens at −inf
    (deterministic: the backward recomputes the same kept set)."""
    z = _upcast(torch.nn.functional.linear(h, weight, bias))
    if temperature != 1.0:
        z = z / temperature
    return filter_logits_(z, targets, *filters) if filters is not None else z


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of ``targets`` (and entropies) under softmax((hidden Wᵀ + b) / τ), without materialising [M, V].

    Equal, within float32 rounding, to ``logprobs_from_logits(linear(hidden, weight, bias), targets, τ, top_k=...,
    top_p=..., min_p=...)`` and ``entropy_from_logits`` of the same (filtered) logits, in value and in gradient (w.r.t.
    ``hidden``, ``weight``, ``bias``), for both outputs. With filters set, the distribution is the one the engine
    sampled from (module docstring) and the entropy is that distribution's; the filters cost a sort of each chunk's
    logits (top-p) or a top-k, in the forward and again in a recomputing backward, and top-p's sort (values + int64
    indices) transiently needs about 5× the chunk's float32 logits (measured on 2 CPU threads, M = 256, V = 49152, H =
    576, forward + backward: ≈ 0.6 s unfiltered, ≈ +0.5 s with top-p, ≈ +0.1 s with top-k or min-p). Without filters the
    path is unchanged.

    Args:
        hidden: [M, H] float, the final hidden states at the M positions that predict ``targets``.
        weight: [V, H] the LM head (same dtype as ``hidden``); bias: [V] or None.
        targets: [M] int64 token ids in [0, V).
        temperature: > 0, the sampling temperature τ.
        chunk_size: positions per chunk; at most chunk_size × V float32 logits exist at once (forward and backward).
            None or chunk_size ≥ M: one chunk, whose softmax is kept for the backward (no recompute). With several
            chunks the backward recomputes each chunk's logits: + 2·M·H·V FLOPs.
        with_entropy: also return the entropies H = −Σ p·log p [M] float32, differentiable like the logprobs (an
            entropy bonus in the loss trains the policy through them; the backward then holds one more [chunk, V]
            float32 buffer).
        top_k, top_p, min_p: the rollout's sampling filters (vLLM semantics, see `filter_logits_`); defaults: off.

    Returns:
        (logprobs [M] float32, differentiable; entropy [M] float32, differentiable, or None).

    Raises:
        ValueError: shapes that do not match, non-integer targets, temperature ≤ 0, chunk_size < 1, a filter out of
            range.
    """
    _check_temperature(temperature)
    _check_filters(top_k, top_p, min_p)
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
    filters = (top_k, float(top_p), float(min_p)) if _filtering(weight.shape[0], top_k, top_p, min_p) else None
    return _LinearLogprobs.apply(hidden, weight, bias, targets.to(torch.int64), float(temperature), chunk_size,
                                 with_entropy, filters)
