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

import threading
from collections.abc import Callable, Mapping
from typing import Any

from grpo.environments.base import Environment, EnvironmentInfraError, Observation, Turn, check_observation
from grpo.environments.scripted import ScriptedEnvironment
from grpo.environments.tool_env import ToolEnvironment
from grpo.registry import Registry

__all__ = ["ENVIRONMENTS", "Environment", "EnvironmentInfraError", "Observation", "Turn", "check_environment",
           "check_observation", "make_environment", "register_environment"]


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


def check_environment(name: str, options: Mapping[str, Any] | None = None, timeout_s: float = 60.0) -> str | None:
    """Whether environment ``name`` can be built with ``options``: one instance is built (in a daemon thread, within
    ``timeout_s`` seconds) and closed. None when it can, else why: what the factory raised (any exception, its type
    and message), that it did not return in time, or the :class:`Environment` methods the instance lacks."""
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            box["env"] = make_environment(name, options)
        except BaseException as exc:  # noqa: BLE001 - reported, whatever the factory raised
            box["error"] = exc

    thread = threading.Thread(target=build, name=f"check-environment-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"building it did not return within {timeout_s:g} s"
    if "error" in box:
        return f"{type(box['error']).__name__}: {box['error']}"
    env = box["env"]
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
    if missing:
        return (f"the factory returned a {type(env).__name__} without the method(s) {missing}; an environment needs "
                f"reset(row), step(turn) and close() (grpo.environments.Environment)")
    try:
        env.close()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"close() raised {type(exc).__name__}: {exc}"
    return None


ENVIRONMENTS["scripted"] = ScriptedEnvironment
ENVIRONMENTS["tools"] = ToolEnvironment
