"""Agents in a job spec (docs/agents.md): ``rollout.agent`` (the user's ``async def run(client, row, **options)``,
named ``path/file.py:function`` or ``module:function`` relative to the spec file, like reward functions; or an
ecosystem library's environment, ``textarena:<id>`` or ``gymnasium:<id>``),
``rollout.agent_options`` (its keyword arguments) and ``rollout.agent_pool`` (the workers its episodes run on, and
an episode's token budget).

The agent is imported and its signature checked when the spec is validated (:func:`check_agent`, through
``cluster.agents.loading``), so ``grpo-cluster validate`` and a job's construction refuse an agent file that does not
import, or a function that is not an ``async def`` taking ``(client, row, **options)``, before any worker starts,
naming ``rollout.agent``, the file and the line. Checks against other sections are in :func:`agent_conflicts`, which
``JobSpec`` runs.

Imports only pydantic and :mod:`cluster.spec` modules (``cluster.agents.loading`` lazily, when an agent is named).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from cluster.spec.fields import (
    MAX_DEVICES_PER_ACTOR, MAX_SEQUENCE_TOKENS, MAX_TIMEOUT_S, SPEC_CONFIG, CustomResources, FieldConflict,
    check_custom_resources,
)

__all__ = ["AGENT_REWARD", "AgentPoolSpec", "agent_conflicts", "check_agent", "context_tokens", "uses_agent_pool"]

#: The reward component of an agent's episode (``reward/agent``): what the agent returned (a dict's total), NaN when
#: it returned None or failed (``cluster.loop.scoring``). With an agent, ``algorithm.rewards`` is empty.
AGENT_REWARD = "agent"


class AgentPoolSpec(BaseModel):
    """Where agents' episodes run (rollout.agent, or rollout.multi_turn with runner 'agent_pool'): worker processes
    (Ray actors; local processes on the in-process runtime), each running many episodes at once in an asyncio loop,
    so that a slow tool call holds only its own episode. An episode that runs past timeout_s, raises, or whose worker
    dies is an infrastructure failure of that episode (no reward, counted in reward/infra_failed), never a stopped
    job; a worker that dies or hangs is replaced."""

    model_config = SPEC_CONFIG
    workers: int = Field(1, ge=1, le=4096, strict=True, description=(
        "Agent workers (Ray actors; local processes on the in-process runtime)."))
    num_cpus_per_worker: float = Field(0.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "CPUs Ray reserves per agent worker. 0 (the default) suits agents that mostly wait on the model and on I/O; "
        "give 1 or more to agents whose episodes run tests, compilers or other CPU-bound tools."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each agent worker reserves besides CPUs, e.g. {sandbox_node: 1}; {} reserves none."))
    episodes_per_worker: int = Field(16, ge=1, le=100_000, strict=True, description=(
        "Episodes one worker runs at once (concurrent coroutines of its event loop); more wait for a free slot. An "
        "agent that blocks the loop (a synchronous sleep, a long computation) holds every episode of its worker: "
        "await, or use asyncio.to_thread."))
    timeout_s: float = Field(600, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds one episode may take on its worker, its model calls included; a longer one is cancelled and is an "
        "infrastructure failure (a worker whose event loop does not answer within this plus 10 s is killed and "
        "replaced, its episodes failed)."))
    start_timeout_s: float = Field(120, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds an agent worker may take to start and import the agent."))
    max_episode_tokens: int = Field(4096, ge=2, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "(rollout.agent) Token budget of an episode: the longest context any of its calls may reach, prompt plus "
        "completion, which is the longest training sequence it becomes. A call's completion is capped at what is "
        "left (and at rollout.max_response_tokens); a call with no room left is refused with the error code "
        "'token_budget', which ends the episode as the policy's failure (reward 0, trained; "
        "episode/token_budget_fraction) unless the agent handles it. With rollout.multi_turn the budget is "
        "multi_turn.max_episode_tokens after the prompt instead."))

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources, "rollout.agent_pool", "worker")


def check_agent(key: str, options: dict, base_dir: str | None) -> None:
    """Import the agent ``key`` names (relative to ``base_dir``, the spec file's folder) and check that it is an
    ``async def`` that takes ``(client, row, **options)`` with these ``options``; or, for an ecosystem library's
    environment (``textarena:<id>``, ``gymnasium:<id>``: ``cluster.agents.kinds.ecosystem_key``), run its kind's
    check (the library installed, the environment one it runs, the options it takes).

    Raises:
        FieldConflict: naming ``rollout.agent`` (the file does not import, no such function, not a coroutine
            function, a signature without two positional parameters; the library missing, no such environment) or
            ``rollout.agent_options`` (an option its signature or kind does not take), with the file and line.
    """
    from cluster.agents.kinds import ecosystem_key
    from cluster.agents.loading import AgentLoadError, check_agent_signature, load_agent
    from cluster.agents.plan import remember_base_dir

    found = ecosystem_key(key)
    if found is not None:
        kind, environment_id = found
        problem = kind.check(environment_id, options, base_dir)
        if problem is not None:
            raise FieldConflict(problem.field, problem.message)
        remember_base_dir(key, base_dir)
        return
    try:
        fn = load_agent(key, base_dir)
        remember_base_dir(key, base_dir)
    except AgentLoadError as exc:
        raise FieldConflict("rollout.agent", str(exc)) from None
    problem = check_agent_signature(fn, key, options)
    if problem is not None:
        raise FieldConflict(problem.field, problem.message)


def uses_agent_pool(rollout) -> bool:
    """Whether the job's episodes run on the agent pool: ``rollout.agent``, or ``rollout.multi_turn`` with
    ``runner: agent_pool``."""
    multi_turn = getattr(rollout, "multi_turn", None)
    return rollout.agent is not None or (multi_turn is not None and multi_turn.runner == "agent_pool")


def context_tokens(rollout, max_prompt_tokens: int) -> int:
    """The longest sequence (prompt + response tokens) an engine must hold for this rollout: an agent's
    ``agent_pool.max_episode_tokens``, else ``data.max_prompt_tokens`` plus the response's budget
    (``multi_turn.max_episode_tokens`` or ``max_response_tokens``)."""
    if rollout.agent is not None:
        return rollout.agent_pool.max_episode_tokens
    multi_turn = getattr(rollout, "multi_turn", None)
    return max_prompt_tokens + (multi_turn.max_episode_tokens if multi_turn is not None
                                else rollout.max_response_tokens)


def agent_conflicts(spec, rewards_given: bool) -> list[FieldConflict]:
    """A job spec's agent settings against its other sections (empty when consistent): with ``rollout.agent``, the
    agent's return is the reward, so ``algorithm.rewards`` (given: ``rewards_given``), the reward pool's workers and
    the DAPO overlong penalty have nothing to act on; partial rollouts interrupt lock-step generate calls, which
    agents do not make (their requests continue across a weight sync by themselves); the reward-hacking guard watches
    named reward functions."""
    rollout, out = spec.rollout, []
    if rollout.agent is None:
        return out
    if rewards_given:
        out.append(FieldConflict("algorithm.rewards", (
            f"an agent (rollout.agent) returns its episode's reward (a float, None or a dict of components): "
            f"expected no algorithm.rewards with it, got {dict(spec.algorithm.rewards)}; score inside the agent "
            f"(grpo.rewards functions are importable there)")))
    if spec.reward_pool.workers:
        out.append(FieldConflict("reward_pool.workers", (
            f"an agent's job has no reward functions to run: expected reward_pool.workers 0 with rollout.agent, got "
            f"{spec.reward_pool.workers} (the agent's own work runs on rollout.agent_pool)")))
    if spec.algorithm.overlong_buffer_tokens is not None:
        out.append(FieldConflict("algorithm.overlong_buffer_tokens", (
            "the DAPO overlong penalty measures one completion against rollout.max_response_tokens; an agent's "
            "episode has a token budget instead (rollout.agent_pool.max_episode_tokens): expected null with "
            "rollout.agent")))
    if spec.monitor is not None and spec.monitor.enabled:
        out.append(FieldConflict("monitor.enabled", (
            "the reward-hacking guard compares named reward functions of algorithm.rewards; an agent's job has none: "
            "expected no monitor section with rollout.agent")))
    return out
