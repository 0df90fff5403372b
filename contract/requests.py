"""Request-level generation: one completion per request, served the moment it is submitted.

Multi-turn episodes and agents (``rollout.agent``) do not wait for each other: each episode submits its next turn as
soon as its observation is ready, and the rollout side serves requests concurrently (vLLM's async engine: continuous
batching). This module holds what crosses that boundary; :class:`RequestServer` is the side of a fleet that takes
such requests (both runtimes' fleets implement it beside ``contract.protocols.Fleet``).

Versions: a request may be paused by a weight sync and continued on the new weights (as partial rollouts are), so
every sampled token carries the policy version that sampled it (:attr:`TokenResult.token_versions`); no token mixes
versions, and no request is lost by a sync.

Notation: P prompt tokens, R sampled tokens.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["RequestServer", "TokenRequest", "TokenResult"]


@dataclass(frozen=True)
class TokenRequest:
    """One completion to sample from exact token ids.

    Attributes:
        request_id: unique among the requests in flight (e.g. ``"e12-c3"``: episode 12, call 3).
        prompt_ids: P token ids the engine continues (already chat-templated; the engine does not tokenize again).
        max_tokens: the completion's length cap, tokens (>= 1).
        temperature, top_p, top_k, min_p: the sampling distribution (the spec's ``rollout`` values unless an
            endpoint call asked for a lower temperature within what the spec allows; held-out evaluation: greedy).
        stop: stop strings (``rollout.stop`` and the call's own); the matched stop text is kept in the sampled
            tokens exactly as sampled.
        seed: seeds this request's sampler alone (None: unseeded).
        group_id, sample: the group and the sample index within it this request belongs to (figures, dispatch: one
            group's requests go to one engine, which shares their prefix cache).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    group_id: int | None = None
    sample: int | None = None


@dataclass(frozen=True)
class TokenResult:
    """What the engine sampled for one :class:`TokenRequest`.

    Attributes:
        request_id: the request's.
        prompt_ids: P token ids the engine saw (equal to the request's; checked by the engine).
        token_ids: R sampled token ids, the stop text or EOS included when sampled.
        logprobs: R floats, natural log, each sampled token's log-probability under the distribution it was sampled
            from (vLLM's ``processed_logprobs``).
        token_versions: R ints, the policy version that sampled each token.
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (hit ``max_tokens``) or ``"abort"`` (the
            engine gave up on it: shut down or failed; the caller treats it as an infrastructure failure).
        stop_reason: the stop string matched, or None (EOS, length, abort).
        text: the sampled tokens decoded (special tokens skipped).
        queue_s: seconds from submission until the engine started the request. engine_s: seconds from that start to
            the result (both wall-clock, on the engine's side).
        engine: which engine served it (``engine-<index>``).
        busy_s: the serving engine's cumulative busy seconds (time it spent sampling served requests) when it made
            this result, a counter that only grows during an engine's life; the fleet derives the engines' idle
            share from it (``rollout/engine_idle_fraction``).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    stop_reason: str | None = None
    text: str = ""
    queue_s: float = 0.0
    engine_s: float = 0.0
    engine: str = field(default="")
    busy_s: float = 0.0


@runtime_checkable
class RequestServer(Protocol):
    """The request-level side of a fleet: requests served concurrently, each resolved on its own."""

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Queue ``request`` and return at once; the future resolves when its completion ends (thread-safe: any
        thread, e.g. an endpoint's event loop through ``asyncio.wrap_future``, may submit).

        The future raises what the runtime raises for a lost engine after the fleet gave up on recovering it (a
        request whose engine died is sampled again from scratch, same seed, on a replacement), and the engine's
        own error for a request it cannot serve (e.g. a prompt longer than its context); a request in flight during
        a weight sync is paused and continued, never failed.
        """
        ...
