"""The ``scripted`` environment: fixed observations after each turn, for tests and benchmarks.

    rollout:
      multi_turn: {environment: scripted, options: {observations: ["Try again.", "Once more."]}, max_turns: 4}

After policy turn k it answers ``observations[k - 1]`` (cycling through the list when ``done_after`` asks for more
turns than it holds) and ends the episode after turn ``done_after`` (default: one turn more than there are
observations). It never looks at what the policy wrote, so an episode's turn count and observation tokens are known
in advance: the token layout of an episode is pinned by tests with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo.environments.base import Observation, Turn

__all__ = ["ScriptedEnvironment"]


class ScriptedEnvironment:
    """Fixed observations (module docstring).

    Args:
        observations: the text answered after turn k, ``observations[(k - 1) % len]``.
        done_after: the episode ends after this many turns (>= 1); None: ``len(observations) + 1``.
        rewards: the reward of turn k, ``rewards[k - 1]`` (turns past the list: none); None: no turn rewards.
        role: the chat role of the observations.

    Raises:
        ValueError: ``done_after`` < 1, or more than one turn with no observation to answer with.
    """

    def __init__(self, observations: Sequence[str] = (), done_after: int | None = None,
                 rewards: Sequence[float] | None = None, role: str = "tool"):
        self.observations = [str(o) for o in observations]
        self.done_after = len(self.observations) + 1 if done_after is None else int(done_after)
        if self.done_after < 1:
            raise ValueError(f"scripted environment: done_after must be >= 1, got {done_after}")
        if self.done_after > 1 and not self.observations:
            raise ValueError(f"scripted environment: done_after={self.done_after} needs at least one observation")
        self.rewards = None if rewards is None else [float(r) for r in rewards]
        self.role = role
        self.row: Mapping[str, Any] | None = None

    def reset(self, row: Mapping[str, Any]) -> None:
        """Start an episode (the row is kept, unused)."""
        self.row = row

    def step(self, turn: Turn) -> Observation:
        """The scripted answer to turn ``turn.index``."""
        reward = None
        if self.rewards is not None and turn.index <= len(self.rewards):
            reward = self.rewards[turn.index - 1]
        if turn.index >= self.done_after:
            return Observation(done=True, reward=reward, role=self.role)
        text = self.observations[(turn.index - 1) % len(self.observations)]
        return Observation(text=text, done=False, reward=reward, role=self.role)

    def close(self) -> None:
        """Nothing to release."""
