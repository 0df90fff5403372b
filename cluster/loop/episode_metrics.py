"""The ``episode/*`` metrics of a step's multi-turn episodes, and the ``eval/*`` ones of held-out episodes.

Every figure is over the episodes sampled (all of a step's sampling rounds; every held-out episode), those whose
environment failed included:

- ``turns_mean``: policy turns per episode; ``tool_calls_mean``: tool calls per episode;
  ``tool_success_rate``: calls that ran without an error the policy caused / calls, over the episodes whose tool
  results the loop sees (NaN without any: a function agent runs its own tools, its ``tool_errors`` is None);
- ``observation_tokens_mean``: observation tokens per episode (masked out of the loss);
- ``done_fraction``, ``max_turns_fraction``, ``token_budget_fraction``: how episodes ended (the environment ended
  it; it hit ``rollout.multi_turn.max_turns``; the next observation would not fit ``max_episode_tokens``);
- ``infra_failed``: episodes whose environment raised or timed out (also in ``reward/infra_failed``);
- ``restarts``: episodes sampled again from their start after an engine was replaced;
- ``environment_s``: environment step seconds summed over episodes (steps of different episodes run at once).

Agents' episodes (``rollout.agent``, or an environment on the agent pool) add ``calls_mean`` (chat-completions
calls per episode; each is a policy turn, so ``turns_mean`` equals it) and ``rewritten_fraction`` (episodes whose
agent rewrote its history, trained as more than one sequence); :func:`component_metrics` gives ``reward/<name>`` of
the components agents returned.

Response lengths elsewhere (``response_length/*``, ``eval/response_length_mean``) count sampled tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from contract.messages import EpisodeSummary

__all__ = ["EVAL_EPISODE_KEYS", "component_metrics", "episode_metrics"]

#: The ``episode_metrics`` keys held-out evaluation reports (as ``eval/<key>``).
EVAL_EPISODE_KEYS = ("turns_mean", "tool_calls_mean", "tool_success_rate", "observation_tokens_mean",
                     "max_turns_fraction", "token_budget_fraction")


def episode_metrics(episodes: Sequence[EpisodeSummary], prefix: str = "episode/") -> dict[str, float]:
    """The figures of the module docstring, keys ``prefix + name``; {} without episodes."""
    n = len(episodes)
    if not n:
        return {}
    calls = sum(e.tool_calls for e in episodes)
    ended = [e.ended for e in episodes]
    figures = {
        "turns_mean": sum(e.turns for e in episodes) / n,
        "tool_calls_mean": calls / n,
        "tool_success_rate": _tool_success_rate(episodes),
        "observation_tokens_mean": sum(e.observation_tokens for e in episodes) / n,
        "done_fraction": ended.count("done") / n,
        "max_turns_fraction": ended.count("max_turns") / n,
        "token_budget_fraction": ended.count("token_budget") / n,
        "infra_failed": float(ended.count("infra_failed")),
        "restarts": float(sum(e.restarts for e in episodes)),
        "environment_s": sum(e.environment_s for e in episodes),
    }
    if any(e.calls is not None for e in episodes):  # agents' episodes
        figures["calls_mean"] = sum(e.calls or 0 for e in episodes) / n
        figures["rewritten_fraction"] = sum(e.rewritten for e in episodes) / n
    return {prefix + k: float(v) for k, v in figures.items()}


def _tool_success_rate(episodes: Sequence[EpisodeSummary]) -> float:
    """(calls − errors) / calls over the episodes whose tool errors are known (``tool_errors`` not None); NaN when
    there are no such calls."""
    seen = [e for e in episodes if e.tool_errors is not None]
    calls = sum(e.tool_calls for e in seen)
    return (calls - sum(e.tool_errors for e in seen)) / calls if calls else math.nan


def component_metrics(episodes: Sequence[EpisodeSummary], prefix: str = "reward/") -> dict[str, float]:
    """``reward/<name>`` for each component agents returned (a dict): its mean over the episodes that returned it and
    did not fail (an infrastructure failure has no reward); {} when none returned components."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        if e.infra_failed or math.isnan(e.turn_reward):
            continue
        for name, value in e.components.items():
            values.setdefault(name, []).append(float(value))
    return {prefix + name: sum(v) / len(v) for name, v in sorted(values.items())}
