"""Partial rollouts (``rollout.partial_rollout``): the bookkeeping of completions interrupted by a weight update and
continued from their tokens. Pure (no vLLM, no Ray), shared by every engine (``rollout_workers.vllm``,
``rollout_workers.hf``): an engine sends the requests :func:`completion_jobs` plans and gathers what comes back with
:func:`assemble_group`.

A weight update does not wait for the longest completion: the engine aborts its unfinished requests (vLLM's own
``LLMEngine.abort_request``), returns the tokens sampled so far with finish reason ``"interrupted"``, the new weights
are loaded, and a later call continues each interrupted completion as a new request whose prompt is the original
prompt followed by the completion's tokens, capped at what is left of the length cap, its sampling otherwise
unchanged. Its KV cache is not kept: the engine recomputes the prompt and the tokens already sampled on the new weights
(one prefill of P + K tokens; the prefix cache was reset by the weight update). Each response token records the policy
version that sampled it, so a trajectory may span versions; its behaviour logprobs stay those of the sampling policy
of each token, which is what the token-level off-policy corrections (``grpo.off_policy``) need.

Sources: AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning", interruptible rollout workers: in-flight generations are interrupted by a weight update and continued on
the new weights with the KV cache recomputed); PipelineRL (Piché et al. 2025, in-flight weight updates: sequences
span several policy versions); slime (THUDM, partial rollouts: aborted requests kept and continued in the next
rollout).

Shapes: G completions per group, P prompt tokens, K tokens already sampled by a completion, R_i tokens of
completion i.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from contract.messages import INTERRUPTED, GroupRequest, GroupResult

__all__ = ["CompletionJob", "CompletionState", "assemble_group", "completion_jobs", "resume_seed"]


def resume_seed(seed: int | None, sample: int, done_tokens: int) -> int | None:
    """The sampling seed of completion ``sample`` of a group seeded ``seed`` (None: unseeded).

    A completion sampled from scratch gets ``seed + sample``: vLLM's own per-completion seed for
    ``SamplingParams(n=G, seed=seed)`` (``vllm.v1.engine.parallel_sampling.ParentRequest``), so a group sampled one
    request per completion equals one sampled in one ``n=G`` request. A completion continued after ``done_tokens``
    > 0 tokens gets a CRC-32 mix of (seed, sample, done_tokens) in [0, 2**31): reusing ``seed + sample`` would replay
    the random numbers its first tokens were drawn with.
    """
    if seed is None:
        return None
    if done_tokens == 0:
        return seed + sample
    return zlib.crc32(f"{seed}:{sample}:{done_tokens}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class CompletionJob:
    """One engine request (``n=1``) for completion ``sample`` of a group.

    Attributes:
        sample: the completion's index in its group, 0..G-1.
        prompt_ids: P + K ints: the group's prompt followed by the K tokens the completion already has.
        max_tokens: tokens it may still sample: the length cap minus K (>= 1).
        seed: :func:`resume_seed`.
        prefix_ids: the K tokens already sampled. prefix_logprobs: [K] float32, their behaviour logprobs.
        prefix_versions: K ints, the policy version that sampled each of them.
    """

    sample: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    prefix_ids: list[int] = field(default_factory=list)
    prefix_logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    prefix_versions: list[int] = field(default_factory=list)


def completion_jobs(request: GroupRequest, group_size: int, max_tokens: int) -> list[CompletionJob]:
    """The engine requests of one group: every completion when ``request.resume_from`` is None, else only its
    interrupted ones, each continued from its tokens (module docstring).

    Args:
        request: the group (G = ``request.group_size`` or ``group_size``).
        max_tokens: the length cap of a whole completion (the request's sampling settings).

    Returns:
        Jobs in sample order (those of completions that need sampling).

    Raises:
        ValueError: ``resume_from`` is of another group, prompt or group size, or holds an interrupted completion
            that already has ``max_tokens`` tokens (it would have finished with ``"length"``).
    """
    g = request.group_size or group_size
    prior = request.resume_from
    if prior is None:
        return [CompletionJob(i, list(request.prompt_ids), max_tokens, resume_seed(request.seed, i, 0))
                for i in range(g)]
    if (prior.group_id, list(prior.prompt_ids), len(prior.response_ids)) != (request.group_id,
                                                                             list(request.prompt_ids), g):
        raise ValueError(f"group {request.group_id}: resume_from is group {prior.group_id} with "
                         f"{len(prior.prompt_ids)} prompt tokens and {len(prior.response_ids)} completions, expected "
                         f"this group's {len(request.prompt_ids)} prompt tokens and {g} completions")
    jobs = []
    for i, reason in enumerate(prior.finish_reasons):
        if reason != INTERRUPTED:
            continue
        done = list(prior.response_ids[i])
        if len(done) >= max_tokens:
            raise ValueError(f"group {request.group_id} completion {i}: interrupted with {len(done)} tokens, expected "
                             f"fewer than the length cap {max_tokens}")
        jobs.append(CompletionJob(i, list(request.prompt_ids) + done, max_tokens - len(done),
                                  resume_seed(request.seed, i, len(done)), done,
                                  prior.behaviour_logprobs[i].to(torch.float32), prior.versions_of(i)))
    return jobs


@dataclass
class CompletionState:
    """What the engine returned so far for one :class:`CompletionJob` (accumulated from vLLM's DELTA outputs).

    Attributes:
        ids: new token ids. logprobs: their behaviour logprobs (natural log). text: their decoded text.
        finish_reason: the engine's (``"stop"``, ``"length"``, ``"abort"``...) once finished; None while running (an
            aborted request never reports one: it is ``"interrupted"``).
        stop_reason: the stop string that ended it (``rollout.stop``), else None.
    """

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, ids: list[int], logprobs: list[float], text: str) -> None:
        """Append one DELTA output's tokens (``len(ids) == len(logprobs)``)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"expected one logprob per token, got {len(ids)} tokens and {len(logprobs)} logprobs")
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.text += text


def assemble_group(request: GroupRequest, group_size: int, sampled: dict[int, tuple[CompletionJob, CompletionState]],
                   engine_version: int, decode: Callable[[list[int]], str]) -> GroupResult:
    """One group's :class:`GroupResult` after an engine call.

    Args:
        request: the group's request; completions not in ``sampled`` are taken from ``request.resume_from`` as they
            are (finished in an earlier call).
        sampled: sample index → (its job, what the engine returned); a state without ``finish_reason`` was aborted
            (``"interrupted"``).
        engine_version: the policy version of the engine's weights during the call (that of every new token).
        decode: token ids → text (the engine's tokenizer, special tokens skipped), for completions with a prefix:
            their text is decoded from all their tokens.

    Returns:
        The group; ``token_versions`` per token; ``policy_version`` the oldest of them (``engine_version`` when no
        completion has a token).
    """
    g = request.group_size or group_size
    prior = request.resume_from
    ids, lps, reasons, texts, versions = [], [], [], [], []
    for i in range(g):
        if i not in sampled:
            if prior is None:
                raise ValueError(f"group {request.group_id}: completion {i} was neither sampled nor resumed")
            ids.append(list(prior.response_ids[i]))
            lps.append(prior.behaviour_logprobs[i])
            reasons.append(prior.finish_reasons[i])
            texts.append(prior.texts[i])
            versions.append(prior.versions_of(i))
            continue
        job, state = sampled[i]
        ids.append(job.prefix_ids + state.ids)
        lps.append(torch.cat([job.prefix_logprobs, torch.tensor(state.logprobs, dtype=torch.float32)]))
        reasons.append(INTERRUPTED if state.finish_reason in (None, "abort")
                       else "length" if state.finish_reason == "length" else "stop")
        texts.append(decode(ids[-1]) if job.prefix_ids else state.text)
        versions.append(job.prefix_versions + [engine_version] * len(state.ids))
    oldest = min((v for vs in versions for v in vs), default=engine_version)
    return GroupResult(request.group_id, list(request.prompt_ids), ids, lps, reasons, texts, oldest, versions)
