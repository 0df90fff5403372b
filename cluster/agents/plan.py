"""What an agent worker needs to run a job's episodes (:class:`AgentPlan`), built in the driver from the validated
spec (:func:`build_plan`) and sent to every worker (a Ray actor, a local process), which builds its agent kind from
it (``cluster.agents.kinds``).

The user's agent lives in a module the loader named itself, which no other process can import by that name: the
worker loads it again from the spec file's folder, which travels as an absolute path and, when it lies inside the
working folder, also relative to it (a Ray job's working dir unpacked elsewhere finds it relative to its own working
folder), as reward functions do (``cluster.rewards.worker``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AgentPlan", "EnvironmentPlan", "agent_base_dir", "agent_kind_name", "build_plan", "remember_base_dir"]

_BASE_DIRS: dict[str, Path] = {}  # rollout.agent key -> the folder it was loaded relative to (the spec file's)


def remember_base_dir(key: str, base_dir: str | Path | None) -> None:
    """Record the folder agent ``key`` was loaded relative to when its spec was validated (``base_dir``, else the
    working folder), for :func:`build_plan`."""
    _BASE_DIRS[key] = Path(base_dir or os.getcwd()).resolve()


def agent_base_dir(key: str) -> Path:
    """The folder agent ``key`` was loaded relative to when its spec was validated here (the working folder when it
    was not)."""
    return _BASE_DIRS.get(key, Path.cwd().resolve())


@dataclass(frozen=True)
class EnvironmentPlan:
    """The ``environment`` kind's settings (``rollout.multi_turn`` with ``runner: agent_pool``).

    Attributes:
        name, options: the environment and its constructor's keywords. max_turns: policy turns at most.
        turn_tokens: one turn's completion cap, tokens. step_timeout_s: seconds a reset, step or close may take.
        system_prompt, prompt_suffix: how the job renders a row's prompt (``data``), so an episode's first call
            sends the messages a single completion's prompt is rendered from (the endpoint renders them with the
            job's chat template).
    """

    name: str
    options: Mapping[str, Any]
    max_turns: int
    turn_tokens: int
    step_timeout_s: float
    system_prompt: str | None = None
    prompt_suffix: str = ""


@dataclass(frozen=True)
class AgentPlan:
    """How a worker builds the job's agent kind.

    Attributes:
        kind: the agent kind's registry name (``function``, ``environment``, ``textarena``, ``gymnasium``;
            :data:`cluster.agents.kinds.AGENT_KINDS`).
        key: ``rollout.agent`` as written (``function`` and the ecosystem kinds), else None.
        folder: (absolute path, path relative to the working folder or None) of the spec file's folder, where a
            ``file.py:function`` key is found.
        options: ``rollout.agent_options``.
        environment: the ``environment`` kind's settings, else None.
        imports: modules to import first (``--import``: they may register environments or helpers).
        timeout_s: seconds one episode may take (``rollout.agent_pool.timeout_s``).
        model: the ``model`` an episode's client names in its calls (the endpoint serves the job's policy whatever
            the name).
    """

    kind: str
    key: str | None = None
    folder: tuple[str, str | None] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    environment: EnvironmentPlan | None = None
    imports: tuple[str, ...] = ()
    timeout_s: float = 600.0
    model: str = "policy"

    def base_dir(self) -> str | None:
        """The folder to load ``key`` from here: the absolute one when it exists, else the relative one under this
        process's working folder."""
        if self.folder is None:
            return None
        absolute, relative = self.folder
        return absolute if os.path.isdir(absolute) or relative is None else os.path.join(os.getcwd(), relative)


def agent_kind_name(rollout) -> str | None:
    """The agent kind a rollout section runs: an ecosystem kind's name (``rollout.agent`` ``<library>:<id>``,
    ``cluster.agents.kinds.ecosystem_key``), ``function`` (any other ``rollout.agent``), ``environment``
    (``rollout.multi_turn`` with ``runner: agent_pool``), or None (no agent pool)."""
    if rollout.agent is not None:
        from cluster.agents.kinds import ecosystem_key

        found = ecosystem_key(rollout.agent)
        return found[0].name if found is not None else "function"
    multi_turn = rollout.multi_turn
    return "environment" if multi_turn is not None and multi_turn.runner == "agent_pool" else None


def build_plan(spec, imports: tuple[str, ...] = ()) -> AgentPlan:
    """The plan of ``spec``'s agent kind (the spec validated in this process, so a ``rollout.agent`` key's folder is
    known: :func:`remember_base_dir`).

    Raises:
        ValueError: the spec has no agent kind (:func:`agent_kind_name` is None).
    """
    rollout = spec.rollout
    kind = agent_kind_name(rollout)
    pool = rollout.agent_pool
    if kind is None:
        raise ValueError("build_plan: the spec has no agent (rollout.agent) nor multi_turn.runner 'agent_pool'")
    if kind != "environment":  # the user's function, or an ecosystem library's environment
        base = agent_base_dir(rollout.agent)
        cwd = Path.cwd().resolve()
        folder = (str(base), str(base.relative_to(cwd)) if base.is_relative_to(cwd) else None)
        return AgentPlan(kind, rollout.agent, folder, dict(rollout.agent_options), None, tuple(imports),
                         pool.timeout_s)
    mt, data = rollout.multi_turn, spec.data
    environment = EnvironmentPlan(mt.environment, dict(mt.options), mt.max_turns,
                                  mt.turn_tokens(rollout.max_response_tokens), mt.step_timeout_s,
                                  data.system_prompt, data.prompt_suffix)
    return AgentPlan("environment", environment=environment, imports=tuple(imports), timeout_s=pool.timeout_s)
