"""The types an environment speaks (:mod:`grpo.environments`): the turn it receives, the observation it answers, its
protocol, and the error that marks an infrastructure failure."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Environment", "EnvironmentInfraError", "Observation", "Turn", "check_observation"]


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
    """One episode's environment (a fresh instance per episode, built with the spec's ``options``).

    Optional attribute ``longest_step_s`` (float): the longest a step can take by the environment's own limits
    (e.g. its tools' time limits), seconds; the spec then refuses a ``rollout.multi_turn.step_timeout_s`` that is
    not longer, which would turn a step the environment still bounds into an infrastructure failure."""

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


def _text_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not usable text for field ``name`` (a str that encodes as UTF-8), else None."""
    if not isinstance(value, str):
        return f"Observation.{name} of type {type(value).__name__}, expected str"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"Observation.{name} that is not valid text ({exc.reason} at character {exc.start}), expected UTF-8 text"
    return None


def check_observation(value: object) -> str | None:
    """Why ``value`` is not a well-formed :class:`Observation`, else None: ``text`` and ``role`` UTF-8 strings
    (``role`` non-empty), ``done`` a bool, ``reward`` None or a finite real number (not a bool), ``tool_calls`` and
    ``tool_errors`` ints >= 0 with ``tool_errors <= tool_calls``. A host treats a malformed one as an infrastructure
    failure of the episode (the environment's bug, not the policy's), naming the field."""
    if not isinstance(value, Observation):
        return f"{type(value).__name__}, expected an Observation"
    problem = _text_problem("text", value.text) or _text_problem("role", value.role)
    if problem is not None:
        return problem
    if not value.role:
        return "an empty Observation.role, expected a chat role such as 'tool' or 'user'"
    if not isinstance(value.done, bool):
        return f"Observation.done={value.done!r}, expected True or False"
    reward = value.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        return f"Observation.reward={reward!r}, expected None or a finite number"
    for name in ("tool_calls", "tool_errors"):
        count = getattr(value, name)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            return f"Observation.{name}={count!r}, expected an int >= 0"
    if value.tool_errors > value.tool_calls:
        return f"Observation.tool_errors={value.tool_errors} > tool_calls={value.tool_calls}, expected at most as many"
    return None
