"""The ``function`` agent kind: the user's ``async def run(client, row, **options)`` (``rollout.agent``), loaded
again in the worker from the spec file's folder and called with ``rollout.agent_options``.

Its return value is the episode's reward as the agent gives it (``cluster.agents.outcomes.outcome_of_return`` reads
it); it is checked again here (a worker may hold a newer file than the one validated).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.agents.loading import AgentLoadError, check_agent_signature, load_agent
from cluster.agents.plan import AgentPlan
from contract.agents import EpisodeRun

__all__ = ["build"]


def build(plan: AgentPlan) -> EpisodeRun:
    """The user's agent with its options bound.

    Raises:
        AgentLoadError: it does not import in this process, or its signature no longer fits (naming the file and
            line).
    """
    fn = load_agent(plan.key, plan.base_dir())
    options = dict(plan.options)
    problem = check_agent_signature(fn, plan.key, options)
    if problem is not None:
        raise AgentLoadError(f"{problem.field}: {problem.message}")

    async def episode(client: Any, row: Mapping[str, Any]) -> Any:
        return await fn(client, row, **options)

    episode.agent_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    return episode
