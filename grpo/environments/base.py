"""The types an environment speaks (:mod:`grpo.environments`): the turn it receives, the observation it answers, its
protocol, and the error that marks an infrastructure failure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Environment", "EnvironmentInfraError", "Observation", "Turn"]


class EnvironmentInfraError(RuntimeError):
    """An environment or tool could not run (not the policy's fault): the episode gets no reward and is counted as
    an infrastructure failure."""


@dataclass(frozen=True)
class Turn:
    """One policy turn, as the environment receives it.

    Attributes:
        text: the turn's sampled tokens decoded (special tokens skipped). token_ids: those tokens.
        index: 1 for the episode's first turn. finish_reason: ``"stop"`` (the policy ended its turn) or
        ``"length"`` (cut at the turn's token cap).
    """

    text: str
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str


@dataclass(frozen=True)
class Observation:
    """What the environment answers a turn with.

    Attributes:
        text: the observation the policy sees next (ignored when ``done``).
        done: the episode ends after this turn.
        reward: this turn's reward (added to the episode's total reward), None: none.
        role: the chat role the observation is rendered as (``"tool"``; ``"user"`` for templates without one).
        tool_calls: tool calls run for this turn. tool_errors: those that failed because of the call.
    """

    text: str = ""
    done: bool = False
    reward: float | None = None
    role: str = "tool"
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """One episode's environment (a fresh instance per episode, built with the spec's ``options``)."""

    def reset(self, row: Mapping[str, Any]) -> None:
        """Start the episode of data row ``row``: ``prompt`` (as the data gave it), ``reference``, and every column.
        Raising is an infrastructure failure."""
        ...

    def step(self, turn: Turn) -> Observation:
        """Answer one policy turn. Raising is an infrastructure failure (module docstring)."""
        ...

    def close(self) -> None:
        """Release what the episode holds (called once it ends, also after a failure)."""
        ...
