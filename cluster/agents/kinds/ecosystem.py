"""What the ecosystem agent kinds share: environments written with another library, named in the spec as
``rollout.agent: "<library>:<environment id>"`` (``textarena:GuessTheNumber-v0``, ``gymnasium:FrozenLake-v1``;
docs/agents.md, "Ecosystem environments") and run unchanged, each episode a chat with the endpoint.

- :class:`EcosystemKind`: what a library's kind registers (``cluster.agents.kinds.register_ecosystem_kind``): its
  episode run, the check the spec's validation runs, the file or module an environment id names, its extra.
- :class:`EpisodeOptions`: the options every ecosystem kind takes (``rollout.agent_options``), read by
  :func:`read_options` (unknown keys and wrong types refused in one line naming the field).
- :class:`Conversation`: an episode's messages. The first observation is the first user message; every later one
  is added as one user message holding what it says beyond the previous observation (an environment that repeats the
  whole game log in every observation, as textarena's wrappers do, would otherwise send it again each turn), or the
  whole observation when it does not start with the previous one. So every call extends the previous call: the
  episode trains as one sequence, its observations masked (docs/agents.md, "How the episodes train").
- :func:`episode_seed`: the seed an episode resets its environment with: the row's ``seed`` column (its name is the
  ``seed_field`` option), else a CRC-32 of the row's prompt. The G episodes of a group share their row, so they play
  the same game and their rewards compare the policy's play, not the draw.

Imports no ecosystem library: each lives in its kind's module only.
"""

from __future__ import annotations

import json
import numbers
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.agents.loading import SignatureProblem
from cluster.agents.outcomes import budget_refusal, one_line
from cluster.agents.plan import AgentPlan
from contract.agents import EpisodeRun

__all__ = ["Conversation", "EcosystemKind", "EpisodeOptions", "episode_seed", "missing_library", "read_options"]


@dataclass(frozen=True)
class EcosystemKind:
    """One ecosystem library's agent kind.

    Attributes:
        name: the library's name: the key's prefix (``<name>:<environment id>``) and the kind's registry name.
        distribution: the package that installs the library (its version is shown by ``grpo-cluster validate``).
        extra: the optional extra of this project that installs it (``pip install 'grpo-cluster[<extra>]'``).
        build: ``build(plan) -> EpisodeRun``, run in each agent worker (``plan.key`` is the whole key).
        check: ``check(environment id, options, spec folder) -> SignatureProblem | None``, run when the spec is
            validated: the library imports, the environment exists and is one the kind runs, the options fit.
        source: ``source(environment id) -> str | None``: the file or module the id names to import first (it
            registers the environment), which ``grpo-cluster submit`` ships with the spec; None when it names none.
    """

    name: str
    distribution: str
    extra: str
    build: Callable[[AgentPlan], EpisodeRun]
    check: Callable[[str, Mapping[str, Any], str | None], SignatureProblem | None]
    source: Callable[[str], str | None] = lambda environment_id: None


class EpisodeOptions(BaseModel):
    """The ``rollout.agent_options`` every ecosystem kind takes."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    system_prompt: str | None = Field(None, description=(
        "The system message of every episode; '' sends none; null: the kind's default."))
    max_tokens: int | None = Field(None, ge=1, description=(
        "Completion cap of one call (one move), tokens; null: rollout.max_response_tokens."))
    max_turns: int = Field(100, ge=1, le=100_000, description=(
        "Moves at most; an episode still running then ends ('max_turns'). Environments end their own games first."))
    seed_field: str = Field("seed", min_length=1, description=(
        "The row's column that seeds the environment's reset; a row without it is seeded by a CRC-32 of its prompt."))
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "Keyword arguments of the library's make call (the environment's constructor)."))
    step_timeout_s: float = Field(60.0, gt=0, le=86_400, description=(
        "Seconds one call into the environment (make, reset, step, close) may take; past it the episode is an "
        "infrastructure failure."))


def read_options(cls: type[EpisodeOptions], options: Mapping[str, Any], kind: str
                 ) -> tuple[EpisodeOptions | None, SignatureProblem | None]:
    """(the options, None), or (None, the problem naming ``rollout.agent_options``, the key and what the kind takes).
    """
    try:
        return cls.model_validate(dict(options)), None
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "(all)"
        known = ", ".join(cls.model_fields)
        return None, SignatureProblem("rollout.agent_options", one_line(
            f"the {kind} agent kind: option {where}: {error['msg']} (got {error.get('input')!r}); it takes: "
            f"{known}"))


def missing_library(kind: str, distribution: str, extra: str, key: str, exc: ImportError) -> SignatureProblem:
    """The problem of a key whose library does not import here."""
    return SignatureProblem("rollout.agent", one_line(
        f"agent {key!r} runs a {kind} environment, but {distribution} does not import here ({type(exc).__name__}: "
        f"{exc}); install the optional extra: pip install 'grpo-cluster[{extra}]'"))


def episode_seed(row: Mapping[str, Any], seed_field: str) -> int:
    """The environment's reset seed for ``row`` (module docstring): ``row[seed_field]`` when it is a whole number (an
    int, or a string of one), else a CRC-32 of the row's prompt (a string, or chat messages as JSON); in [0, 2^31).
    """
    value = row.get(seed_field)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value) % 2**31
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value) % 2**31
    prompt = row.get("prompt", "")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class Conversation:
    """An episode's chat messages (module docstring).

    Args:
        system_prompt: the system message, None or '' for none. model: the ``model`` each call names.
        max_tokens: each call's completion cap, None: the endpoint's.
    """

    def __init__(self, system_prompt: str | None, model: str, max_tokens: int | None):
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.model = model
        self.max_tokens = max_tokens
        self._previous: str | None = None

    def observe(self, text: str) -> None:
        """Add an observation's text as the next user message (its new part, module docstring)."""
        previous, self._previous = self._previous, text
        new = text
        if previous is not None and text.startswith(previous) and text[len(previous):].strip():
            new = text[len(previous):]
        self.messages.append({"role": "user", "content": new.strip() or text})

    async def reply(self, client: Any) -> str | None:
        """One call with the messages so far; the reply's text (added as the assistant's message), or None when the
        endpoint refused the call for the episode's token budget.

        Raises:
            what the client raised for any other reason (the episode is then an infrastructure failure).
        """
        extra = {} if self.max_tokens is None else {"max_tokens": self.max_tokens}
        try:
            response = await client.chat.completions.create(model=self.model, messages=self.messages, **extra)
        except Exception as exc:  # noqa: BLE001 - the budget ends the episode; anything else is raised on
            if budget_refusal(exc):
                return None
            raise
        text = response.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": text})
        return text
