"""The ``hf`` engine's decode loop: KV-cached sampling of many completions with transformers, in one batch.

Each completion is one row of a left-padded batch: one prefill of every row's prompt (the group's prompt, followed,
for a continued partial rollout, by the tokens it already has), then one token per row per step from the model's
``past_key_values`` (a ``DynamicCache``). Rows that finish leave the batch (``DynamicCache.batch_select_indices``).

The distribution each token is drawn from is the rollout's: logits / temperature, then the min-p, top-k and top-p
filters as vLLM's sampler applies them (``grpo.logprobs.filter_logits_``), renormalised. A token's behaviour logprob
is its log-probability under that distribution (``grpo.logprobs.logprobs_from_logits`` of the filtered logits), which
is what the trainer recomputes (``train_workers.policy.ResponseLogprobModel``), so the two agree to float32 rounding.
Greedy decoding (temperature 0, held-out evaluation) takes the argmax and reports the unfiltered log-softmax at
temperature 1.

Randomness: every row has its own ``torch.Generator`` seeded with its job's seed; a token is drawn as vLLM draws it
(``vllm/v1/sample/ops/topk_topp_sampler.random_sample``: argmax of p / q with q ~ Exp(1) over the vocabulary). A
row's tokens therefore depend only on the weights, its prompt and its seed, never on the other rows of the batch.

Stop strings (``Sampling.stop``): each row's text is checked after every token with the vLLM engine's semantics
(:class:`rollout_workers.stops.StopScanner`): the row ends with the token that completes a stop string, all of it kept.

Shapes: n rows, P_i prompt tokens of row i, L = max P_i, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from contract.messages import GroupRequest, GroupResult
from grpo.logprobs import filter_logits_, logprobs_from_logits
from rollout_workers.partial import CompletionState, assemble_group, completion_jobs
from rollout_workers.stops import StopScanner

__all__ = ["RowJob", "Sampling", "request_sampling", "sample_groups", "sample_rows"]

#: Rows decoded together at most (a larger call is split into several batches, one after the other).
MAX_BATCH_ROWS = 64


@dataclass(frozen=True)
class Sampling:
    """How one completion is sampled.

    Attributes:
        temperature: > 0, or 0 for greedy decoding. top_k: 0 or -1 off. top_p: in (0, 1], 1 off. min_p: in [0, 1),
        0 off (vLLM's semantics, ``grpo.logprobs.filter_logits_``). max_tokens: the completion's length cap in
        tokens. stop: stop strings (``rollout.stop``; :mod:`rollout_workers.stops`).
    """

    temperature: float
    max_tokens: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class RowJob:
    """One completion to sample.

    Attributes:
        prompt_ids: P ints, what the completion continues (a prompt, or a prompt and a partial completion).
        max_tokens: new tokens it may sample (>= 1). seed: its generator's seed. sampling: its distribution (its
        ``max_tokens`` is the whole completion's cap; ``max_tokens`` here is what is left of it).
        prefix_tokens: how many of ``prompt_ids``' last ids the completion sampled before (a continued one): its
            stop strings are searched across them and the new tokens.
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    seed: int
    sampling: Sampling
    prefix_tokens: int = 0


def sample_rows(model: torch.nn.Module, jobs: Sequence[RowJob], eos_ids: frozenset[int],
                interrupted: Callable[[], bool] | None = None, max_batch_rows: int = MAX_BATCH_ROWS,
                decode: Callable[[list[int]], str] | None = None) -> list[CompletionState]:
    """Sample every job; returns one :class:`rollout_workers.partial.CompletionState` per job, in job order.

    Jobs with the same :class:`Sampling` are decoded together, ``max_batch_rows`` rows at a time. A row ends with
    finish reason ``"stop"`` when it samples an id of ``eos_ids`` (kept as its last token) or completes one of its
    stop strings (``stop_reason`` the string, ``text`` cut at its end), or ``"length"`` when it has ``max_tokens``
    tokens; when ``interrupted()`` returns True (checked before every token step, the prefill's included) the
    unfinished rows end with finish reason None (interrupted) and the tokens they have.

    Args:
        model: an HF causal LM (or a PEFT model wrapping one) in eval mode; its parameters' device is used.
        eos_ids: the ids that end a completion.
        decode: token ids → text, special tokens skipped; needed when a job's sampling has stop strings.

    Returns:
        states with ``ids`` (new tokens), ``logprobs`` (float, natural log, under the row's sampling distribution)
        and ``finish_reason``; ``text`` is left empty (the caller decodes) unless a stop string ended the row.

    Raises:
        ValueError: a job with an empty prompt or ``max_tokens`` < 1, or stop strings without ``decode``.
    """
    for i, job in enumerate(jobs):
        if not job.prompt_ids or job.max_tokens < 1:
            raise ValueError(f"row {i}: expected a non-empty prompt and max_tokens >= 1, got {len(job.prompt_ids)} "
                             f"prompt tokens and max_tokens={job.max_tokens}")
        if job.sampling.stop and decode is None:
            raise ValueError(f"row {i}: stop strings {list(job.sampling.stop)} need a decode function, got none")
    states = [CompletionState() for _ in jobs]
    by_sampling: dict[Sampling, list[int]] = {}
    for i, job in enumerate(jobs):
        by_sampling.setdefault(job.sampling, []).append(i)
    for sampling, rows in by_sampling.items():
        for start in range(0, len(rows), max_batch_rows):
            chunk = rows[start:start + max_batch_rows]
            _decode(model, [jobs[i] for i in chunk], [states[i] for i in chunk], sampling, eos_ids, interrupted,
                    decode)
    return states


def request_sampling(request: GroupRequest, rollout) -> Sampling:
    """A request's sampling: the spec's ``rollout`` temperature, filters and ``max_response_tokens``, or its
    ``SamplingOverride`` (its temperature, 0 greedy, and ``max_tokens``; no filters); ``rollout.stop`` either way, as
    the vLLM engine's ``_sampling``."""
    o, stop = request.sampling, tuple(rollout.stop)
    if o is not None:
        return Sampling(temperature=float(o.temperature), max_tokens=int(o.max_tokens), stop=stop)
    return Sampling(temperature=float(rollout.temperature), max_tokens=int(rollout.max_response_tokens),
                    top_k=int(rollout.top_k), top_p=float(rollout.top_p), min_p=float(rollout.min_p), stop=stop)


def sample_groups(model: torch.nn.Module, tokenizer, eos_ids: frozenset[int], requests: Sequence[GroupRequest],
                  rollout, version: int, unseeded: Callable[[], int], interrupted: Callable[[], bool] | None = None,
                  max_batch_rows: int = MAX_BATCH_ROWS, group_size: int | None = None) -> list[GroupResult]:
    """Sample ``requests``' completions on ``model`` and assemble their groups as the engine does: every completion
    of every group (or, resuming, only the interrupted ones, from their tokens), all in one :func:`sample_rows` call.

    Args:
        tokenizer: decodes completions (special tokens skipped). rollout: the spec's ``rollout`` (group size,
            sampling). version: the policy version of ``model``'s weights. unseeded: a seed for a completion whose
            request has none. interrupted, max_batch_rows: as :func:`sample_rows`. group_size: G of a request
            without its own (default ``rollout.group_size``).

    Returns:
        One group per request, in request order.

    Raises:
        ValueError: a request's ``resume_from`` does not fit it (``rollout_workers.partial.completion_jobs``).
    """
    group_size = group_size or rollout.group_size
    planned, rows = [], []  # (request index, CompletionJob), RowJob
    for k, req in enumerate(requests):
        sampling = request_sampling(req, rollout)
        for job in completion_jobs(req, group_size, req.length_cap(sampling.max_tokens)):
            seed = job.seed if job.seed is not None else unseeded()
            planned.append((k, job))
            rows.append(RowJob(job.prompt_ids, job.max_tokens, seed, sampling, len(job.prefix_ids)))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    states = sample_rows(model, rows, eos_ids, interrupted, max_batch_rows, decode)
    per_group: list[dict] = [{} for _ in requests]
    for (k, job), state in zip(planned, states):
        if state.stop_reason is None:  # a stop string's text is cut at its end already
            state.text = decode(state.ids)
        per_group[k][job.sample] = (job, state)
    return [assemble_group(req, group_size, per_group[k], version, decode) for k, req in enumerate(requests)]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _decode(model: torch.nn.Module, jobs: list[RowJob], states: list[CompletionState], sampling: Sampling,
            eos_ids: frozenset[int], interrupted: Callable[[], bool] | None,
            decode: Callable[[list[int]], str] | None) -> None:
    """Decode one batch of rows sharing ``sampling`` into ``states`` (see :func:`sample_rows`)."""
    from transformers import DynamicCache

    device = _device(model)
    lengths = [len(j.prompt_ids) for j in jobs]
    width = max(lengths)
    input_ids = torch.zeros(len(jobs), width, dtype=torch.long)
    mask = torch.zeros(len(jobs), width, dtype=torch.long)
    for r, job in enumerate(jobs):  # left padding: every row's last prompt token is at position width - 1
        input_ids[r, width - lengths[r]:] = torch.tensor(list(job.prompt_ids), dtype=torch.long)
        mask[r, width - lengths[r]:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
    generators = [torch.Generator().manual_seed(int(job.seed)) for job in jobs]
    active = list(range(len(jobs)))  # batch row → job index
    scanners = None
    if sampling.stop:
        scanners = [StopScanner(sampling.stop, decode, list(j.prompt_ids)[len(j.prompt_ids) - j.prefix_tokens:])
                    for j in jobs]
    cache = DynamicCache(config=getattr(model, "config", None))
    while active:
        if interrupted is not None and interrupted():
            return  # unfinished rows keep finish_reason None: interrupted
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        tokens, logprobs = _pick(out.logits[:, -1, :], sampling, [generators[j] for j in active])
        keep = []
        for b, j in enumerate(active):
            token = int(tokens[b])
            state = states[j]
            state.add([token], [float(logprobs[b])], "")
            if token in eos_ids:
                state.finish_reason = "stop"
            elif scanners is not None and scanners[j].add(token):
                state.finish_reason, state.stop_reason, state.text = "stop", scanners[j].stop_reason, scanners[j].text
            elif len(state.ids) >= jobs[j].max_tokens:
                state.finish_reason = "length"
            else:
                keep.append(b)
        if len(keep) < len(active):
            if not keep:
                return
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask, positions, tokens = mask[index], positions[index], tokens[index.cpu()]
            active = [active[b] for b in keep]
        input_ids = tokens.view(-1, 1).to(device)
        mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1


def _pick(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour logprob.

    Args:
        logits: [n, V] the last position's logits (any float dtype; computed in float32).
        generators: one per row (unused when greedy).

    Returns:
        (tokens [n] int64 on the CPU, logprobs [n] float32 on the CPU).
    """
    z = logits.float().cpu()
    if sampling.greedy:
        tokens = z.argmax(dim=-1)
        return tokens, logprobs_from_logits(z, tokens)
    z = z / sampling.temperature if sampling.temperature != 1.0 else z
    filter_logits_(z, None, sampling.top_k, sampling.top_p, sampling.min_p)
    probs = torch.softmax(z, dim=-1)
    tokens = torch.empty(len(generators), dtype=torch.long)
    for r, gen in enumerate(generators):
        q = torch.empty_like(probs[r]).exponential_(generator=gen)
        tokens[r] = (probs[r] / q).argmax()
    return tokens, logprobs_from_logits(z, tokens)
