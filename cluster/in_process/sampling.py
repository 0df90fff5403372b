"""The in-process fleet's decode loop: KV-cached sampling of many completions with transformers, in one batch.

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

Shapes: n rows, P_i prompt tokens of row i, L = max P_i, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from contract.messages import GroupRequest, GroupResult
from grpo.logprobs import filter_logits_, logprobs_from_logits
from rollout_workers.partial import CompletionState, assemble_group, completion_jobs

__all__ = ["RowJob", "Sampling", "request_sampling", "sample_groups", "sample_rows"]

#: Rows decoded together at most (a larger call is split into several batches, one after the other).
MAX_BATCH_ROWS = 64


@dataclass(frozen=True)
class Sampling:
    """How one completion is sampled.

    Attributes:
        temperature: > 0, or 0 for greedy decoding. top_k: 0 or -1 off. top_p: in (0, 1], 1 off. min_p: in [0, 1),
        0 off (vLLM's semantics, ``grpo.logprobs.filter_logits_``). max_tokens: the completion's length cap in
        tokens.
    """

    temperature: float
    max_tokens: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

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
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    seed: int
    sampling: Sampling


def sample_rows(model: torch.nn.Module, jobs: Sequence[RowJob], eos_ids: frozenset[int],
                stop: Callable[[], bool] | None = None, max_batch_rows: int = MAX_BATCH_ROWS
                ) -> list[CompletionState]:
    """Sample every job; returns one :class:`rollout_workers.partial.CompletionState` per job, in job order.

    Jobs with the same :class:`Sampling` are decoded together, ``max_batch_rows`` rows at a time. A row ends with
    finish reason ``"stop"`` when it samples an id of ``eos_ids`` (kept as its last token), or ``"length"`` when it
    has ``max_tokens`` tokens; when ``stop()`` returns True (checked before every token step, the prefill's
    included) the unfinished rows end with finish reason None (interrupted) and the tokens they have.

    Args:
        model: an HF causal LM (or a PEFT model wrapping one) in eval mode; its parameters' device is used.
        eos_ids: the ids that end a completion.

    Returns:
        states with ``ids`` (new tokens), ``logprobs`` (float, natural log, under the row's sampling distribution)
        and ``finish_reason``; ``text`` is left empty (the caller decodes).

    Raises:
        ValueError: a job with an empty prompt or ``max_tokens`` < 1.
    """
    for i, job in enumerate(jobs):
        if not job.prompt_ids or job.max_tokens < 1:
            raise ValueError(f"row {i}: expected a non-empty prompt and max_tokens >= 1, got {len(job.prompt_ids)} "
                             f"prompt tokens and max_tokens={job.max_tokens}")
    states = [CompletionState() for _ in jobs]
    by_sampling: dict[Sampling, list[int]] = {}
    for i, job in enumerate(jobs):
        by_sampling.setdefault(job.sampling, []).append(i)
    for sampling, rows in by_sampling.items():
        for start in range(0, len(rows), max_batch_rows):
            chunk = rows[start:start + max_batch_rows]
            _decode(model, [jobs[i] for i in chunk], [states[i] for i in chunk], sampling, eos_ids, stop)
    return states


def request_sampling(request: GroupRequest, rollout) -> Sampling:
    """A request's sampling: the spec's ``rollout`` temperature, filters and ``max_response_tokens``, or its
    ``SamplingOverride`` (its temperature, 0 greedy, and ``max_tokens``; no filters), as
    ``RolloutEngine._sampling``."""
    o = request.sampling
    if o is not None:
        return Sampling(temperature=float(o.temperature), max_tokens=int(o.max_tokens))
    return Sampling(temperature=float(rollout.temperature), max_tokens=int(rollout.max_response_tokens),
                    top_k=int(rollout.top_k), top_p=float(rollout.top_p), min_p=float(rollout.min_p))


def sample_groups(model: torch.nn.Module, tokenizer, eos_ids: frozenset[int], requests: Sequence[GroupRequest],
                  rollout, version: int, unseeded: Callable[[], int], stop: Callable[[], bool] | None = None,
                  max_batch_rows: int = MAX_BATCH_ROWS) -> list[GroupResult]:
    """Sample ``requests``' completions on ``model`` and assemble their groups as the engine does: every completion
    of every group (or, resuming, only the interrupted ones, from their tokens), all in one :func:`sample_rows` call.

    Args:
        tokenizer: decodes completions (special tokens skipped). rollout: the spec's ``rollout`` (group size,
            sampling). version: the policy version of ``model``'s weights. unseeded: a seed for a completion whose
            request has none. stop, max_batch_rows: as :func:`sample_rows`.

    Returns:
        One group per request, in request order.

    Raises:
        ValueError: a request's ``resume_from`` does not fit it (``rollout_workers.partial.completion_jobs``).
    """
    planned, rows = [], []  # (request index, CompletionJob), RowJob
    for k, req in enumerate(requests):
        sampling = request_sampling(req, rollout)
        for job in completion_jobs(req, rollout.group_size, req.length_cap(sampling.max_tokens)):
            seed = job.seed if job.seed is not None else unseeded()
            planned.append((k, job))
            rows.append(RowJob(job.prompt_ids, job.max_tokens, seed, sampling))
    states = sample_rows(model, rows, eos_ids, stop, max_batch_rows)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    per_group: list[dict] = [{} for _ in requests]
    for (k, job), state in zip(planned, states):
        state.text = decode(state.ids)
        per_group[k][job.sample] = (job, state)
    return [assemble_group(req, rollout.group_size, per_group[k], version, decode) for k, req in enumerate(requests)]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _decode(model: torch.nn.Module, jobs: list[RowJob], states: list[CompletionState], sampling: Sampling,
            eos_ids: frozenset[int], stop: Callable[[], bool] | None) -> None:
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
    cache = DynamicCache(config=getattr(model, "config", None))
    while active:
        if stop is not None and stop():
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
