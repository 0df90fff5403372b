"""One open episode at the endpoint: its record, the conversation its last call left, and how a new call's prompt
ids are made from it.

Token exactness (what ``cluster.loop.agent_sequences`` builds the training sequences from):

- A call **extends** the episode when its messages are the previous call's messages, then the assistant message
  the endpoint returned for it (as returned, or with the completion's whole text as its content and no tool calls),
  then new messages, and its ``tools`` are the previous call's (compared in normal form:
  ``cluster.endpoint.chat_request.normal_message``). Its prompt ids are then the previous call's prompt ids + the
  ids the engine sampled (exactly as sampled: a ``<think>`` block a template would strip stays) + the new
  messages' tokens (``ObservationTokens.after_turn``: the template's delimiters, each text tokenised as plain text,
  so a tool output spelling ``<|im_end|>`` is that text, never the token). Nothing is tokenised twice.
- Any other call (the first, or the agent rewrote its history: a summary, a dropped or edited turn, other tools) is
  rendered afresh (``ObservationTokens.render_ids``) and does not extend; with ``rollout.endpoint.rewritten_history:
  refuse`` such a call after the first is refused instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cluster.endpoint.chat_request import Refusal
from cluster.loop.observation_tokens import ObservationTokenError, ObservationTokens
from contract.agents import CallRecord, EpisodeRecord

__all__ = ["OpenEpisode", "plan_prompt"]


@dataclass
class OpenEpisode:
    """An episode the endpoint serves.

    Attributes:
        key: the loop's episode key. token: its URL's path segment. seed: its seed (None: unseeded).
        max_episode_tokens: bound on prompt + completion tokens of any of its calls. group_id, sample: for the
            engine's dispatch (one group's requests share a prefix cache). temperature: the loop's sampling
            temperature for its calls (held-out evaluation; 0 greedy), None: the spec's sampling.
        record: what the loop gets at close. lock: serialises its calls (an agent's concurrent calls queue, each
            then extending the one served before it, or not).
        history: the normal-form messages of its last served call and the assistant message returned for it; None
            before the first. echoes: the forms that assistant message may come back in. tools: the last call's.
        calls: calls planned so far (the next call's number - 1). failed: why it cannot continue (an engine gave up
            on one of its calls), "" while it can. closed: the loop closed it.
    """

    key: str
    token: str
    seed: int | None
    max_episode_tokens: int
    group_id: int | None = None
    sample: int | None = None
    temperature: float | None = None
    record: EpisodeRecord = field(init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    history: list[dict] | None = None
    echoes: list[dict] = field(default_factory=list)
    tools: list | None = None
    calls: int = 0
    failed: str = ""
    closed: bool = False

    def __post_init__(self):
        self.record = EpisodeRecord(self.key)

    @property
    def last_call(self) -> CallRecord | None:
        return self.record.calls[-1] if self.record.calls else None

    def new_messages(self, messages: list[dict], tools: list | None) -> list[dict] | None:
        """The messages after the history when ``messages`` extend it (module docstring), else None."""
        history = self.history
        if history is None or self.last_call is None or (tools or None) != (self.tools or None):
            return None
        n = len(history)
        if len(messages) < n or messages[:n - 1] != history[:n - 1] or messages[n - 1] not in self.echoes:
            return None
        return messages[n:]

    def remember(self, messages: list[dict], tools: list | None, returned: dict, raw_text: str) -> None:
        """Keep a served call's conversation: its messages + the assistant message ``returned`` (normal form), which
        may also come back as the completion's whole text ``raw_text``."""
        self.history, self.tools = [*messages, returned], tools
        self.echoes = [returned, {"role": "assistant", "content": raw_text}]


def plan_prompt(episode: OpenEpisode, messages: list[dict], tools: list | None, tokens: ObservationTokens,
                rewritten_history: str) -> tuple[list[int], bool]:
    """The prompt ids of ``episode``'s next call and whether they extend its previous call (module docstring).

    Raises:
        Refusal: 400 when the messages rewrite the history and ``rewritten_history`` is ``"refuse"``, or when the
            chat template fails on them.
    """
    new = episode.new_messages(messages, tools)
    try:
        if new is not None:
            last = episode.last_call
            return [*last.prompt_ids, *last.completion_ids, *tokens.after_turn(last.completion_ids, new)], True
        if episode.history is not None and rewritten_history == "refuse":
            raise Refusal(400, f"the messages do not extend the episode's history (its {len(episode.history)} "
                          f"messages, the last the assistant message returned, then new ones) and "
                          f"rollout.endpoint.rewritten_history is 'refuse'", "rewritten_history")
        return tokens.render_ids(messages, tools), False
    except ObservationTokenError as exc:
        raise Refusal(400, str(exc), "chat_template") from None
