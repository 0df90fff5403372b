"""Agents (``rollout.agent``): programs written against the OpenAI chat API, run on an agent pool, served by the
rollout side's chat-completions endpoint, and trained token for token from what the endpoint recorded.

The three parts and what crosses between them:

- the **endpoint** (:class:`AgentEndpoint`, served by the rollout side): one base URL per episode; every call's
  prompt token ids, sampled ids, behaviour logprobs and policy versions are recorded (:class:`CallRecord`) and handed
  back when the episode closes (:class:`EpisodeRecord`);
- the **agent pool** (:class:`AgentPool`, workers of a runtime: Ray actors or local processes): runs one episode of the
  user's agent (``async def run(client, row, **options)``) with an ``openai.AsyncOpenAI`` client pointed at the
  episode's base URL and returns its :class:`AgentOutcome`;
- the **loop** (``cluster.loop``): opens the episodes of a group on the endpoint, submits them to the pool, closes them
  when their outcomes arrive and builds the training sequences from the records, never from re-tokenised text.

Plain dataclasses (they cross process boundaries). Notation: P prompt tokens, R sampled tokens of one call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["TOKEN_BUDGET_ERROR", "AgentEndpoint", "AgentOutcome", "AgentPool", "CallRecord", "EpisodeRecord",
           "EpisodeRun", "EpisodeTicket"]

#: The error code (the OpenAI error body's ``code``, HTTP 400) the endpoint answers a call with when the call would
#: pass its episode's token budget (``open_episode``'s ``max_episode_tokens``: no room left for one more token). An
#: agent that lets the error end its episode ends it as a policy failure (``AgentOutcome.failure`` ``"policy"``,
#: ended ``"token_budget"``), never an infrastructure one: the policy's own tokens filled the budget.
TOKEN_BUDGET_ERROR = "token_budget"


@dataclass(frozen=True)
class CallRecord:
    """One chat-completions call of an episode, as the engine served it.

    Attributes:
        prompt_ids: P token ids the engine continued: the previous call's ``prompt_ids + completion_ids`` followed by
            the new messages' tokens when the call's messages extend the previous call's (``extends`` True), else the
            messages rendered afresh with the chat template.
        completion_ids: R sampled token ids (stop text / EOS included as sampled).
        logprobs: R behaviour logprobs (natural log). token_versions: R policy versions.
        finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"`` (as the endpoint answered the call); ``"abort"``
            when the engine gave up on it.
        extends: the call's prompt starts with the previous call's prompt + completion (False for the first call and
            for a call whose messages rewrote the history: a summary, a dropped turn).
        tool_calls: tool calls parsed from the completion.
        seconds: wall seconds the call took at the endpoint (queue + engine + the endpoint's own work).
        engine_s: the engine's share of ``seconds``. queue_s: time waiting for the engine.
        endpoint_s: the endpoint's own work: ``seconds`` less the time it waited for the engine's result (reading
            the call, its prompt ids, decoding, tool-call parsing, the response).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    extends: bool
    tool_calls: int = 0
    seconds: float = 0.0
    engine_s: float = 0.0
    queue_s: float = 0.0
    endpoint_s: float = 0.0


@dataclass
class EpisodeRecord:
    """Every call of one episode, in order, and how the endpoint saw the episode end.

    Attributes:
        episode_key: the key the loop opened it with. calls: its :class:`CallRecord` s.
        refused: calls the endpoint refused (after the episode closed, over its token budget, malformed), each a
            one-line reason.
    """

    episode_key: str
    calls: list[CallRecord] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AgentOutcome:
    """What one episode of an agent returned.

    Attributes:
        reward: the episode's reward (a finite float), or None (no reward: the episode is excluded, counted).
        components: named reward components when the agent returned a dict (each logged as ``reward/<name>``; the
            reward is their sum unless the dict holds ``"reward"``); {} otherwise.
        failure: ``""`` on success; else ``"infra"`` (the agent raised, hung past ``rollout.agent_pool.timeout_s``,
            its worker died, returned what is not a reward) or ``"policy"`` (the agent ran but the episode is the
            policy's fault: a call was refused with :data:`TOKEN_BUDGET_ERROR`; its reward is then 0.0);
            ``detail`` says why in one line.
        detail: one line for the log. seconds: wall seconds the episode took on its worker.
        ended: how the agent kind says the episode ended, an ``EpisodeSummary.ended`` value (the ``environment``
            kind: ``"done"``, ``"max_turns"``, ``"token_budget"``); ``""``: the loop decides (``"done"`` when the
            agent returned, ``"token_budget"`` for a policy failure, ``"infra_failed"`` for an infrastructure one).
        figures: counts the agent kind reports about the episode (the ``environment`` kind: ``tool_calls``,
            ``tool_errors``, ``environment_s``); {} for a function agent.
    """

    reward: float | None
    components: Mapping[str, float] = field(default_factory=dict)
    failure: str = ""
    detail: str = ""
    seconds: float = 0.0
    ended: str = ""
    figures: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeTicket:
    """One episode to run on the agent pool.

    Attributes:
        episode_key: unique among open episodes. base_url: the endpoint's URL for this episode (an OpenAI client's
            ``base_url``). row: every column of the data row, ``prompt`` as the data gave it, ``reference``.
    """

    episode_key: str
    base_url: str
    row: Mapping[str, Any]


@runtime_checkable
class AgentEndpoint(Protocol):
    """The rollout side's chat-completions endpoint (OpenAI-compatible), one base URL per episode."""

    def open_episode(self, episode_key: str, *, seed: int | None, max_episode_tokens: int,
                     group_id: int | None = None, sample: int | None = None,
                     temperature: float | None = None) -> str:
        """Start recording episode ``episode_key`` and return its base URL. ``seed`` seeds its calls (call k gets a
        seed derived from it and k); ``max_episode_tokens`` bounds prompt + completion tokens of its last call.
        ``temperature``: the calls' sampling temperature (held-out evaluation: ``eval.temperature``, 0 greedy);
        None (the loop leaves it out in training): the spec's ``rollout`` sampling."""
        ...

    def close_episode(self, episode_key: str) -> EpisodeRecord:
        """Stop serving the episode (later calls are refused with a one-line reason) and return its record."""
        ...


@runtime_checkable
class AgentPool(Protocol):
    """Workers that run agent episodes (``rollout.agent_pool``)."""

    def start(self) -> None:
        """Start the workers with the agent loaded (idempotent). Raises naming ``rollout.agent`` when it cannot."""
        ...

    def submit(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Run one episode; the future never raises for the agent's own faults (they are outcomes)."""
        ...

    def describe(self) -> str:
        ...

    def metrics(self) -> dict[str, float]:
        """The pool's ``agent_pool/*`` figures so far (cumulative counts)."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class EpisodeRun(Protocol):
    """One episode of an agent kind, as a worker runs it (``cluster.agents.kinds``: the user's ``async def run``
    with its options bound, or an environment driven through the endpoint): awaited with an ``openai.AsyncOpenAI``
    client pointed at the episode's base URL and the ticket's row, it returns the episode's reward (a float, None, or
    a dict of named components)."""

    def __call__(self, client: Any, row: Mapping[str, Any]) -> Awaitable[Any]:
        ...
