"""Loading the user's agent (``rollout.agent``) and checking its signature before any worker starts.

The contract (docs/agents.md)::

    async def run(client, row, **options) -> float | None | dict[str, float]

``client`` is an ``openai.AsyncOpenAI`` for the episode's endpoint, ``row`` the data row (``prompt`` as the data gave
it, ``reference``, every column), ``options`` the spec's ``rollout.agent_options``. The function is named like a
reward function (``path/to/file.py:function`` relative to the spec file, or ``module:function``) and imported with
the same loader (``grpo.rewards.loading.load_located``), so its errors name the file and line the same way.

:func:`check_agent_signature` is what ``grpo-cluster validate`` and a job's construction run (through the spec's
validation, ``cluster.spec.agents.check_agent``); a worker loads the function again from the spec file's folder
(:func:`load_agent`) and runs it as the ``function`` agent kind (``cluster.agents.kinds.function``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.rewards.calling import RewardError, where_defined
from grpo.rewards.loading import load_located

__all__ = ["AgentLoadError", "SignatureProblem", "check_agent_signature", "load_agent"]

CONTRACT = "async def run(client, row, **options)"


def _contract(name: str) -> str:
    """:data:`CONTRACT` with the user's function's own name in place of ``run``."""
    return CONTRACT.replace("run(", f"{name}(", 1)


def _function_name(fn: Callable, key: str) -> str:
    """The user's function's name (through ``functools.partial``), else the name ``key`` gives it."""
    return getattr(getattr(fn, "func", fn), "__name__", None) or key.rsplit(":", 1)[-1]


class AgentLoadError(ValueError):
    """The agent cannot be imported or is not a usable function; the message names the key, the file and line."""


@dataclass(frozen=True)
class SignatureProblem:
    """Why an agent function cannot be called as the contract says: the spec field to blame (``rollout.agent`` or
    ``rollout.agent_options``) and a one-line message naming the file and line."""

    field: str
    message: str


def load_agent(key: str, base_dir: str | Path | None = None) -> Callable:
    """Import the function ``key`` names (``path/to/file.py:function`` relative to ``base_dir``, the spec file's
    folder, or ``module:function``).

    Raises:
        AgentLoadError: the file is missing or does not import (naming ``file:line`` of the error), no such function,
            or not callable.
    """
    try:
        return load_located(key, base_dir, what="agent")
    except RewardError as exc:
        raise AgentLoadError(str(exc)) from None


def _coroutine_function(fn: Callable) -> bool:
    """``async def`` (also through ``functools.partial``, decorators that keep ``__wrapped__``, or an object whose
    ``__call__`` is one)."""
    target = inspect.unwrap(getattr(fn, "func", fn))
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def check_agent_signature(fn: Callable, key: str, options: Mapping[str, Any]) -> SignatureProblem | None:
    """None when ``fn`` is an ``async def`` that ``fn(client, row, **options)`` can call; else the problem.

    Checked: a coroutine function (a plain ``def`` returns no coroutine to await; an async generator is not one
    either); two positional parameters for ``client`` and ``row``; every option a keyword it takes (or ``**options``);
    no other parameter without a default.
    """
    where, name = where_defined(fn), _function_name(fn, key)
    contract = _contract(name)
    if not _coroutine_function(fn):
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else \
            "a plain function (def)" if inspect.isfunction(fn) else f"a {type(fn).__name__}"
        return SignatureProblem("rollout.agent", (
            f"agent {key!r}: {where}: {name} is {kind}; expected {contract} (an async function, awaited once per "
            f"episode)"))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return SignatureProblem("rollout.agent", f"agent {key!r}: {where}: no readable signature ({exc})")
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in positional):
        return SignatureProblem("rollout.agent", (
            f"agent {key!r}: {where}: {name}{signature} takes {len(positional)} positional parameter(s); "
            f"expected {contract} (client, row)"))
    try:
        signature.bind(object(), {}, **dict(options))
    except TypeError as exc:
        field = "rollout.agent_options" if options else "rollout.agent"
        return SignatureProblem(field, (
            f"agent {key!r}: {where}: cannot be called as {name}(client, row, **{dict(options)}): {exc}; expected "
            f"{contract} taking every key of rollout.agent_options"))
    return None
