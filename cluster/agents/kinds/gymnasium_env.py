"""The ``gymnasium`` agent kind: ``rollout.agent: "gymnasium:<environment id>"`` runs a Gymnasium text environment
(``gymnasium`` 1.x, the optional extra ``gymnasium``) unchanged, one episode per ``reset``, each step a chat call to
the endpoint (docs/agents.md, "Ecosystem environments").

The id is anything ``gymnasium.make`` takes (``FrozenLake-v1``), or ``<module or file.py>:<id>``: the module (or the
file, relative to the spec file, like a reward function's) is imported first, so an environment it registers with
``gymnasium.register`` is found (``gymnasium:arithmetic_env.py:ArithmeticDrill-v0``).

**A text environment** is one whose observations can be read and whose actions can be written as text:

- observations: a ``gymnasium.spaces.Text`` observation space (the observation is the text), or any observation
  space with an ``"ansi"`` render mode (the toy-text environments: FrozenLake, CliffWalking, Taxi): the text is
  ``env.render()`` made with ``render_mode="ansi"``, its terminal colours dropped and each coloured span shown in
  brackets (FrozenLake marks the player's square so: ``[F]``);
- actions: a ``Text`` action space (the reply's text is the action, stripped) or a ``Discrete(n, start)`` one (the
  reply's last whole number in ``[start, start + n)``, or, with ``action_names``, the last of those names it says).

Anything else (pixels, Box actions, Blackjack's tuple without an ``ansi`` mode) is refused when the spec is validated.
The first user message is ``instructions`` (by default, for a ``Discrete`` space, which replies are moves), a blank
line and the first observation; every step's observation is the next user message
(:class:`~cluster.agents.kinds.ecosystem.Conversation`).

Reward: the episode's return, the sum of the step rewards. It ends when the environment terminates (``done``), is
truncated (its ``TimeLimit``) or ``max_turns`` steps are taken (``max_turns``), when a call is refused for the
episode's token budget (``token_budget``), or on a reply that is no action of a ``Discrete`` space (``done``, with
``reward/invalid_action`` 1): always with the return so far. The environment raising, or a call into it past
``step_timeout_s``, is an infrastructure failure. ``env.reset(seed=...)``:
:func:`~cluster.agents.kinds.ecosystem.episode_seed`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from cluster.agents.kinds.ecosystem import (
    Conversation, EcosystemKind, EpisodeOptions, episode_seed, missing_library, read_options,
)
from cluster.agents.kinds.environment import call_in_thread
from cluster.agents.loading import AgentLoadError, SignatureProblem
from cluster.agents.outcomes import one_line
from cluster.agents.plan import AgentPlan
from contract.agents import AgentOutcome, EpisodeRun
from grpo.environments import EnvironmentInfraError
from grpo.rewards.calling import RewardError
from grpo.rewards.loading import import_target

__all__ = ["KIND", "GymnasiumOptions", "TextSpaces", "build", "check", "source"]

NAME = "gymnasium"
_TIMEOUT = "rollout.agent_options.step_timeout_s"
_COLOURED = re.compile(r"\x1b\[[0-9;]*m([^\x1b]*)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NUMBER = re.compile(r"-?\d+")


class GymnasiumOptions(EpisodeOptions):
    """``rollout.agent_options`` of a gymnasium environment."""

    instructions: str | None = Field(None, description=(
        "Text before the first observation; null: for a Discrete action space, which replies are moves; '' none."))
    action_names: list[str] | None = Field(None, min_length=1, description=(
        "Names of a Discrete space's actions in order (left, down, right, up): the reply's last name said is the "
        "action; null: the reply's last whole number."))


def _gymnasium():
    import gymnasium

    return gymnasium


def source(environment_id: str) -> str | None:
    """The module or ``.py`` file ``<target>:<id>`` names, None for a plain id."""
    target, sep, _ = environment_id.rpartition(":")
    return target if sep else None


def ansi_text(rendered: Any) -> str:
    """``env.render()`` of ``render_mode="ansi"`` as plain text: each coloured span in brackets, escapes dropped."""
    text = rendered.getvalue() if hasattr(rendered, "getvalue") else str(rendered)
    return _ESCAPE.sub("", _COLOURED.sub(r"[\1]", text)).strip("\n")


class TextSpaces:
    """How an environment's observations become text and replies become actions (module docstring).

    Args:
        env: a made environment. action_names: ``GymnasiumOptions.action_names``.

    Raises:
        ValueError: not a text environment, or ``action_names`` not one per action (the message says why).
    """

    def __init__(self, env: Any, action_names: list[str] | None):
        gym = _gymnasium()
        Text, Discrete = gym.spaces.Text, gym.spaces.Discrete
        obs, act = env.observation_space, env.action_space
        self.text_observations = isinstance(obs, Text)
        if not self.text_observations and env.render_mode != "ansi":
            raise ValueError(f"its observation space is {obs}, not Text, and it renders no 'ansi' text (render "
                             f"modes {env.metadata.get('render_modes', [])})")
        if not isinstance(act, (Text, Discrete)):
            raise ValueError(f"its action space is {act}; expected Text or Discrete")
        self.text_actions = isinstance(act, Text)
        self.start, self.n = (0, 0) if self.text_actions else (int(act.start), int(act.n))
        if action_names is not None and (self.text_actions or len(action_names) != self.n):
            raise ValueError(f"rollout.agent_options.action_names has {len(action_names)} name(s); expected one per "
                             f"action of its action space {act}")
        self.names = [n.lower() for n in action_names] if action_names else None

    def observation(self, env: Any, observation: Any) -> str:
        """The text of ``observation`` (the environment's render with ``ansi`` observations)."""
        return str(observation) if self.text_observations else ansi_text(env.render())

    def instructions(self) -> str:
        """The default instructions: which replies are actions ('' for a Text action space)."""
        if self.text_actions:
            return ""
        if self.names:
            return f"Reply with one action: {', '.join(self.names[:-1])} or {self.names[-1]}."
        return f"Reply with one action: a whole number from {self.start} to {self.start + self.n - 1}."

    def action(self, reply: str) -> Any:
        """The action ``reply`` says, None when it says none."""
        if self.text_actions:
            return reply.strip()
        if self.names:
            said = [(m.start(), i) for i, name in enumerate(self.names)
                    for m in re.finditer(rf"\b{re.escape(name)}\b", reply.lower())]
            return self.start + max(said)[1] if said else None
        numbers = [int(x) for x in _NUMBER.findall(reply) if self.start <= int(x) < self.start + self.n]
        return numbers[-1] if numbers else None


def _make(environment_id: str, opts: GymnasiumOptions, base_dir: str | None) -> Any:
    """The environment, its source imported first; made again with ``render_mode="ansi"`` when its observations are
    not Text and it renders ``ansi`` text (unless ``env_kwargs`` chose a render mode)."""
    gym = _gymnasium()
    target = source(environment_id)
    if target is not None:
        import_target(f"{NAME}:{environment_id}", target, base_dir, what="agent")
    name = environment_id.rpartition(":")[2]
    env = gym.make(name, **opts.env_kwargs)
    if (isinstance(env.observation_space, gym.spaces.Text) or "render_mode" in opts.env_kwargs
            or "ansi" not in (env.metadata.get("render_modes") or [])):
        return env
    env.close()
    return gym.make(name, render_mode="ansi", **opts.env_kwargs)


def check(environment_id: str, options: Mapping[str, Any], base_dir: str | None) -> SignatureProblem | None:
    """The spec's check (``EcosystemKind.check``): the options, gymnasium importable, the environment made and a text
    environment (module docstring)."""
    key = f"{NAME}:{environment_id}"
    opts, problem = read_options(GymnasiumOptions, options, NAME)
    if problem is not None:
        return problem
    try:
        _gymnasium()
    except ImportError as exc:
        return missing_library(NAME, "gymnasium", "gymnasium", key, exc)
    try:
        env = _make(environment_id, opts, base_dir)
    except RewardError as exc:
        return SignatureProblem("rollout.agent", one_line(str(exc)))
    except Exception as exc:  # noqa: BLE001 - an unknown id, a constructor that raised: one line
        return SignatureProblem("rollout.agent", one_line(
            f"agent {key!r}: gymnasium.make cannot make it ({type(exc).__name__}: {exc}) with "
            f"rollout.agent_options.env_kwargs = {dict(opts.env_kwargs)}"))
    try:
        TextSpaces(env, opts.action_names)
    except ValueError as exc:
        if "action_names" in str(exc):
            return SignatureProblem("rollout.agent_options", one_line(f"agent {key!r}: {exc}"))
        return SignatureProblem("rollout.agent", one_line(f"agent {key!r} is not a text environment the gymnasium "
                                                          f"kind runs: {exc}"))
    finally:
        env.close()
    return None


def build(plan: AgentPlan) -> EpisodeRun:
    """The episode run of ``plan.key`` (module docstring).

    Raises:
        AgentLoadError: :func:`check` finds a problem here.
    """
    environment_id = plan.key.partition(":")[2]
    base_dir = plan.base_dir()
    problem = check(environment_id, plan.options, base_dir)
    if problem is not None:
        raise AgentLoadError(f"{problem.field}: {problem.message}")
    opts = GymnasiumOptions.model_validate(dict(plan.options))

    async def in_thread(fn, what: str, *args, **kwargs):
        return await call_in_thread(lambda: fn(*args, **kwargs), opts.step_timeout_s, what, _TIMEOUT)

    async def episode(client: Any, row: Mapping[str, Any]) -> AgentOutcome:
        t0 = time.perf_counter()
        env = await in_thread(_make, "make", environment_id, opts, base_dir)
        try:
            spaces = TextSpaces(env, opts.action_names)
            observation, _ = await in_thread(env.reset, "reset", seed=episode_seed(row, opts.seed_field))
            first = await in_thread(spaces.observation, "render", env, observation)
            seconds = time.perf_counter() - t0
            instructions = spaces.instructions() if opts.instructions is None else opts.instructions
            conversation = Conversation(opts.system_prompt, plan.model, opts.max_tokens)
            conversation.observe(f"{instructions}\n\n{first}" if instructions else first)
            total, ended, invalid = 0.0, "max_turns", 0.0
            for turn in range(1, opts.max_turns + 1):
                reply = await conversation.reply(client)
                if reply is None:
                    ended = "token_budget"
                    break
                action = spaces.action(reply)
                if action is None:
                    ended, invalid = "done", 1.0
                    break
                t0 = time.perf_counter()
                observation, reward, terminated, truncated, _ = await in_thread(env.step, "step", action)
                total += float(reward)
                if terminated or truncated:
                    ended = "done" if terminated else "max_turns"
                    seconds += time.perf_counter() - t0
                    break
                if turn < opts.max_turns:
                    conversation.observe(await in_thread(spaces.observation, "render", env, observation))
                seconds += time.perf_counter() - t0
        finally:
            try:
                await in_thread(env.close, "close")
            except EnvironmentInfraError:
                pass  # the episode is over; a failed close is not its failure
        return AgentOutcome(total, {"invalid_action": invalid}, ended=ended, figures={"environment_s": seconds})

    return episode


KIND = EcosystemKind(NAME, "gymnasium", "gymnasium", build, check, source)
