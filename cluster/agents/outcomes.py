"""What one agent episode ended as (:class:`contract.agents.AgentOutcome`): the agent's return value read as a reward
(:func:`outcome_of_return`), or what it raised read as a failure (:func:`outcome_of_error`).

Whose fault it is decides what the loop does with the episode (docs/agents.md):

- a float (an int too, not a bool) is the reward; None is no reward (excluded from the loss and the group's
  statistics, counted in ``reward/infra_failed``); a dict of named finite floats is the components (each logged as
  ``reward/<name>``), summed into the reward unless it holds ``"reward"``, which is then the reward itself;
- anything else returned (a string, NaN, ±inf or an int too large for a float, a bool, an empty dict, components
  that sum to ±inf, a component named like a metric the loop reports) is the agent program's bug: an
  **infrastructure** failure (no reward, counted), never a reward of 0;
- a raise is an infrastructure failure, except a call the endpoint refused with
  :data:`contract.agents.TOKEN_BUDGET_ERROR` (the policy's own tokens filled the episode's budget): a **policy**
  failure, trained with reward 0 and counted in ``episode/token_budget_fraction``.

Every outcome's ``detail`` is one line (at most :data:`MAX_DETAIL` characters), with the agent file's line where the
agent raised, for the driver's log.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Mapping
from typing import Any

from contract.agents import TOKEN_BUDGET_ERROR, AgentOutcome
from grpo.rewards import RESERVED_REWARD_NAMES

__all__ = ["MAX_DETAIL", "RESERVED_COMPONENTS", "budget_refusal", "one_line", "outcome_of_error",
           "outcome_of_return"]

#: Longest ``AgentOutcome.detail``, characters.
MAX_DETAIL = 300
#: Component names an agent may not return: the loop's own ``reward/*`` metrics, and ``agent`` (the episode's total).
RESERVED_COMPONENTS = frozenset({*RESERVED_REWARD_NAMES, "agent"})
EXPECTED = "expected a float, None (no reward) or a dict of named floats"


def one_line(text: str, limit: int = MAX_DETAIL) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


#: Largest float32 (``torch.finfo(torch.float32).max``): a reward beyond it becomes ±inf in the float32 reward tensor,
#: so it is refused as ±inf is (as ``grpo.rewards.calling`` refuses a reward function's).
FLOAT32_MAX = 3.4028234663852886e38


def _finite(value: Any) -> float | None:
    """``value`` as a finite float when it is a real number (not a bool) that is one as a float32; else None (NaN,
    ±inf, a number beyond float32's range, an int too large for a float, a number type whose conversion fails)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) and abs(number) <= FLOAT32_MAX else None


def outcome_of_return(value: Any, seconds: float) -> AgentOutcome:
    """The outcome of an agent that returned ``value`` after ``seconds`` (module docstring). An
    :class:`AgentOutcome` (what the ``environment`` kind returns) is kept, with ``seconds`` set."""
    if isinstance(value, AgentOutcome):
        return AgentOutcome(value.reward, dict(value.components), value.failure, value.detail, seconds, value.ended,
                            dict(value.figures))
    if value is None:
        return AgentOutcome(None, detail="the agent returned None (no reward)", seconds=seconds)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = _finite(value)
        if number is None:
            return _bad_return(value, seconds, "not a finite number")
        return AgentOutcome(number, seconds=seconds)
    if isinstance(value, Mapping):
        return _components(value, seconds)
    return _bad_return(value, seconds, "")


def _components(value: Mapping, seconds: float) -> AgentOutcome:
    if not value:
        return _bad_return(value, seconds, "an empty dict")
    for name, v in value.items():
        if not isinstance(name, str) or not name or "/" in name:
            return _bad_return(value, seconds, f"component name {name!r} is not a plain string")
        if name in RESERVED_COMPONENTS:
            return _bad_return(value, seconds, f"component {name!r} is reserved (reward/{name} is the loop's own "
                                               f"metric; reserved: {', '.join(sorted(RESERVED_COMPONENTS))})")
        if _finite(v) is None:
            return _bad_return(value, seconds, f"component {name!r} is {one_line(repr(v), 40)}, not a finite number")
    components = {k: _finite(v) for k, v in value.items() if k != "reward"}
    reward = _finite(value["reward"]) if "reward" in value else sum(components.values())
    if reward is None or not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
        return _bad_return(value, seconds, f"its components sum to {reward}, not a finite float32 number")
    return AgentOutcome(reward, components, seconds=seconds)


def _bad_return(value: Any, seconds: float, why: str) -> AgentOutcome:
    shown = one_line(repr(value), 80)
    reason = f" ({why})" if why else ""
    return AgentOutcome(None, failure="infra", seconds=seconds, ended="infra_failed", detail=one_line(
        f"the agent returned {shown} of type {type(value).__name__}{reason}; {EXPECTED}"))


def budget_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) is the endpoint's refusal of a call with
    :data:`TOKEN_BUDGET_ERROR` (an ``openai.APIStatusError`` whose ``code`` is it, or whose body names it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        body = getattr(exc, "body", None)
        codes = {getattr(exc, "code", None)}
        if isinstance(body, Mapping):
            error = body.get("error", body)
            codes.add(error.get("code") if isinstance(error, Mapping) else None)
        if TOKEN_BUDGET_ERROR in codes:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _site(exc: BaseException, agent_file: str | None) -> str:
    """``file:line`` where the agent raised: the deepest frame in its own file, else the deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if agent_file is not None and f.filename == agent_file] or frames[-1:]
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else "?"


def outcome_of_error(exc: BaseException, seconds: float, agent_file: str | None = None) -> AgentOutcome:
    """The outcome of an agent that raised ``exc`` after ``seconds`` (module docstring); ``agent_file``: the agent's
    source file, whose line is named in the detail."""
    if budget_refusal(exc):
        return AgentOutcome(0.0, failure="policy", seconds=seconds, ended="token_budget", detail=one_line(
            f"a call was refused for the episode's token budget ({TOKEN_BUDGET_ERROR}): trained with reward 0"))
    return AgentOutcome(None, failure="infra", seconds=seconds, ended="infra_failed", detail=one_line(
        f"the agent raised {type(exc).__name__}: {exc} ({_site(exc, agent_file)})"))
