"""The ``rollout.multi_turn`` section: episodes of several policy turns with an environment between them.

Imports only pydantic and :mod:`cluster.spec` modules (the environment registry, ``grpo.environments``, is imported
when a spec is validated, as the variant registries are: :mod:`cluster.spec.variants`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from cluster.spec.algorithm import FieldConflict
from cluster.spec.fields import MAX_SEQUENCE_TOKENS, MAX_TIMEOUT_S, SPEC_CONFIG, unused_when_off
from cluster.spec.variants import Registered

__all__ = ["ENVIRONMENT", "ENVIRONMENT_REWARD", "MultiTurnSpec", "generated_tokens"]

#: The reward component of an episode's environment (``reward/environment``): the sum of its turn rewards, NaN when
#: the environment failed (``cluster.loop.scoring``); no reward function may take the name in a multi-turn job.
ENVIRONMENT_REWARD = "environment"


def _environments():
    from grpo.environments import ENVIRONMENTS

    return ENVIRONMENTS


#: ``rollout.multi_turn.environment`` reads the environment registry (checked by :class:`MultiTurnSpec`).
ENVIRONMENT = Registered("rollout.multi_turn.environment", "environment", "grpo.environments.ENVIRONMENTS",
                         '@register_environment("NAME") from grpo.environments', _environments)


class MultiTurnSpec(BaseModel):
    """Multi-turn episodes (cluster.loop.episodes): after each policy turn an environment answers with an observation
    (a tool's output, a user's reply) that the policy reads before its next turn, until the environment ends the
    episode or a limit does. A group is G episodes of one prompt; the reward functions score each whole episode and
    its advantage applies to every token the policy sampled in it. Observation tokens are tokenised once, with the
    chat template's turn delimiters, and masked out of the loss, the KL and the entropy; the engines continue each
    episode from its token ids (never from re-rendered text), so the trainer scores exactly what was sampled."""

    model_config = SPEC_CONFIG
    environment: str = Field(min_length=1, description=ENVIRONMENT.describe(
        "The environment answering each turn", "tools (tool calls to a calculator and a sandboxed Python tool), "
        "scripted (fixed observations, for tests)"))
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "Keyword arguments of the environment's constructor, e.g. {tools: [calculator, python], max_output_chars: "
        "800} for 'tools' (grpo.environments.tool_env). Checked by building one environment when the spec is "
        "validated."))
    max_turns: int = Field(ge=1, le=1000, strict=True, description=(
        "Policy turns per episode at most (>= 1); an episode still running after this many ends and is scored as "
        "it is (counted in episode/max_turns_fraction)."))
    max_episode_tokens: int = Field(ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Token budget of an episode after its prompt: sampled and observation tokens together (what the engines' "
        "context and the trainer's packing must hold beyond the prompt), at least one turn's cap. A turn is capped "
        "at what is left; an observation that would leave no room for another turn ends the episode "
        "(episode/token_budget_fraction)."))
    max_turn_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Tokens one policy turn may sample; null: rollout.max_response_tokens."))
    step_timeout_s: float = Field(60.0, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds an environment step (or reset, close, or its build when the spec is checked) may take; a slower "
        "one is an infrastructure failure (the episode gets no reward and is counted in reward/infra_failed, like "
        "an environment that raises). Must exceed the environment's own bound on a step where it has one ('tools': "
        "max_calls_per_turn x (sandbox wall_time_s + 1 s) with the python tool)."))
    parallel: int = Field(4, ge=1, le=4096, strict=True, description=(
        "Environment steps run at once (threads in the driver's process; tools' programs run in their own "
        "sandboxes); runner 'lock_step' only."))
    runner: Literal["lock_step", "agent_pool"] = Field("lock_step", description=(
        "How episodes run. 'lock_step' (the default): one generate call samples the next turn of every running "
        "episode, then the environments answer every finished turn at once in the driver's threads "
        "(cluster.loop.episodes; partial rollouts supported). 'agent_pool': the environment is one more agent kind "
        "(docs/agents.md): each episode runs on the agent pool (rollout.agent_pool), off the driver, its turns chat "
        "calls to the rollout side's endpoint, each served the moment its observation is ready, so no episode waits "
        "for another; the token layout (prompt, sampled turns, observation tokens with the template's delimiters) "
        "is the same."))

    @model_validator(mode="after")
    def _runner_settings(self) -> MultiTurnSpec:
        if self.runner == "agent_pool":
            unused_when_off(self, ("parallel",), "rollout.multi_turn", "rollout.multi_turn.runner: lock_step (with "
                            "agent_pool each episode's environment steps run on its agent worker)")
        return self

    @model_validator(mode="after")
    def _registered_environment(self) -> MultiTurnSpec:
        from grpo.environments import check_environment

        try:
            ENVIRONMENT.check(self.environment)
        except ValueError as exc:  # the registered names and how to register one
            raise FieldConflict("rollout.multi_turn.environment", str(exc)) from None
        problem = check_environment(self.environment, self.options, timeout_s=self.step_timeout_s)
        if problem is not None:
            raise FieldConflict("rollout.multi_turn.options", (
                f"environment {self.environment!r} cannot be built with options {dict(self.options)}: {problem}"))
        longest = longest_step_s(self.environment, self.options)
        if longest is not None and self.step_timeout_s <= longest:
            raise FieldConflict("rollout.multi_turn.step_timeout_s", (
                f"expected more than the {longest:g} s a step of environment {self.environment!r} may take by its "
                f"own limits with options {dict(self.options)} (for 'tools': max_calls_per_turn x (sandbox "
                f"wall_time_s + 1 s)), got {self.step_timeout_s:g}: a slow program of the policy's would end the "
                f"episode as an infrastructure failure instead of an observation. Raise step_timeout_s, or lower "
                f"options.max_calls_per_turn or options.sandbox.wall_time_s"))
        return self

    def turn_tokens(self, max_response_tokens: int) -> int:
        """Tokens one policy turn may sample: ``max_turn_tokens``, or ``rollout.max_response_tokens``."""
        return self.max_turn_tokens if self.max_turn_tokens is not None else max_response_tokens


def longest_step_s(environment: str, options: dict[str, Any]) -> float | None:
    """Seconds a step of ``environment`` built with ``options`` may take by its own limits: its
    ``longest_step_s`` attribute (``grpo.environments.tool_env.ToolEnvironment`` has one); None when it has none."""
    from grpo.environments import make_environment

    env = make_environment(environment, options)
    try:
        value = getattr(env, "longest_step_s", None)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    finally:
        env.close()


def generated_tokens(rollout) -> int:
    """Tokens a sequence may hold after its prompt: ``rollout.multi_turn.max_episode_tokens`` for episodes, else
    ``rollout.max_response_tokens`` (what the engines' context must hold beyond ``data.max_prompt_tokens``; an
    agent's budget includes its prompt: ``cluster.spec.agents.context_tokens``)."""
    multi_turn = getattr(rollout, "multi_turn", None)
    return multi_turn.max_episode_tokens if multi_turn is not None else rollout.max_response_tokens
