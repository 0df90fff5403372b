"""Environments for multi-turn rollouts: what answers each policy turn of an episode, and their registry.

An episode starts from one data row (its prompt is the row's chat prompt, as for a single completion). After each
policy turn the episode's environment receives the turn (:class:`Turn`: its text and token ids) and returns an
:class:`Observation`: the text the policy sees next (tokenised once by the loop, with the chat template's turn
delimiters, and masked out of the loss), whether the episode is done, and optionally a reward for the turn. The
episode's final reward is computed by the reward functions on the whole episode, as for a single completion
(``algorithm.rewards``); turn rewards are added to it (``reward/environment``).

Whose fault a failure is decides what happens to the episode:

- a tool error the policy caused (a tool call that is not JSON, an unknown tool, a program that raises, an output
  over the budget, truncated with a note) is an **observation**: the environment returns it as text and the policy
  sees it on its next turn;
- an environment or tool **infrastructure failure** (the sandbox cannot start, the environment raised, a step that
  does not return within ``rollout.multi_turn.step_timeout_s``) ends the episode without a reward: its row is
  excluded from the loss and counted in ``reward/infra_failed``, as a None reward is. An environment signals one by
  raising (:class:`EnvironmentInfraError` names the case; any exception counts).

Environments are registered like reward functions and named in the spec (``rollout.multi_turn.environment``, its
constructor's keyword arguments in ``rollout.multi_turn.options``)::

    from grpo.environments import register_environment

    @register_environment("guess")
    class Guess:
        def __init__(self, hint: str = "higher or lower"): ...
        def reset(self, row): ...                # a fresh instance per episode; row: prompt, reference, columns
        def step(self, turn): return Observation("higher", done=False)
        def close(self): ...

Built in: ``tools`` (:mod:`grpo.environments.tool_env`: ``<tool_call>{json}</tool_call>`` calls to a calculator and a
sandboxed Python tool) and ``scripted`` (:mod:`grpo.environments.scripted`: fixed observations, for tests).
Environments run where rewards run (in the driver's process, ``cluster.loop.environment_host``), never on the
rollout engines. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from grpo.environments.base import Environment, EnvironmentInfraError, Observation, Turn
from grpo.environments.scripted import ScriptedEnvironment
from grpo.environments.tool_env import ToolEnvironment
from grpo.registry import Registry

__all__ = ["ENVIRONMENTS", "Environment", "EnvironmentInfraError", "Observation", "Turn", "check_environment",
           "make_environment", "register_environment"]


EnvironmentFactory = Callable[..., Environment]

#: name → a factory (usually the class) called with the spec's ``rollout.multi_turn.options`` as keywords.
ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("environment")

#: How a spec names an environment that is not registered yet.
HOW_TO_REGISTER = ('@register_environment("NAME") from grpo.environments in a module imported before the spec is '
                   'validated (e.g. grpo-cluster run --import MODULE)')


def register_environment(name: str):
    """Decorator adding an environment factory (a class, or a function returning an environment) to
    :data:`ENVIRONMENTS` under ``name``.

    Raises:
        ValueError: a name already registered.
    """
    def decorator(factory):
        ENVIRONMENTS[name] = factory
        return factory

    return decorator


def make_environment(name: str, options: Mapping[str, Any] | None = None) -> Environment:
    """A fresh environment ``name`` built with ``options`` as keyword arguments.

    Raises:
        ValueError: ``name`` is not registered (naming the registered ones). The factory's own errors.
    """
    return ENVIRONMENTS.lookup(name)(**dict(options or {}))


def check_environment(name: str, options: Mapping[str, Any] | None = None) -> str | None:
    """Whether environment ``name`` can be built with ``options`` (one instance is built and closed); None when it
    can, else why (the factory's TypeError/ValueError message)."""
    try:
        env = make_environment(name, options)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    env.close()
    return None


ENVIRONMENTS["scripted"] = ScriptedEnvironment
ENVIRONMENTS["tools"] = ToolEnvironment
