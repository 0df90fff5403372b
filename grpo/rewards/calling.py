"""How a reward function is called: its calling convention, ``async`` functions, and what it must return.

Two conventions, told apart by the function's parameters (:func:`signature_of`):

- **whole row** (the TRL convention): ``fn(prompts=..., completions=..., **columns)``. ``prompts`` holds each row's
  prompt as the data gave it (a string, or a list of ``{role, content}`` messages), ``completions`` the N completion
  texts, and every other column of the rows one keyword of the same name, each a list of N values (one per
  completion: the G completions of a group repeat their row's values). Only the keywords the function takes are
  passed, all of them when it has ``**kwargs``.
- **references** (the original one): ``fn(completions, references)``, two positional lists of N strings; the
  reference is the row's answer column (``data.answer_field``), the text after its last ``####`` when it has one.
  A function takes it when it has exactly two required positional parameters, no ``**kwargs``, none named
  ``prompts``, and is not ``(completions, <other name>)`` (that one asks for the column of that name).

Either may be ``async def`` (or return an awaitable): it is run to completion with :mod:`asyncio` (in a helper thread
when the calling thread already runs an event loop). It returns N values: a finite float (ints and bools count), or
None (NaN likewise) for "no score": TRL's convention, "this reward does not apply to this row" — the row's total is
the weighted sum of the rewards that do score it, and a row no weighted reward scores is an infrastructure failure
(``grpo.rewards.combine_rewards``). A verifier that could not score a row it applies to (its service or sandbox
failed) returns :data:`UNSCORED` there: that row has no reward (an infrastructure failure) whatever the other rewards
give it, as when a weighted function raises. ±inf is refused, naming the function and where it is defined.

Errors name the function's file and line (:func:`where_defined`) and are :class:`RewardError` s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from numbers import Real
from typing import Any, Literal

import torch

__all__ = ["REFERENCES", "RESERVED_KEYWORDS", "UNSCORED", "WHOLE_ROW", "RewardError", "RewardOutputError",
           "RewardSignature", "call_reward", "run_awaitable", "signature_of", "unscored_rows", "values_to_tensor",
           "where_defined"]

REFERENCES: Literal["references"] = "references"
WHOLE_ROW: Literal["row"] = "row"
#: Keywords every whole-row reward gets from the loop; no data column may be named so.
RESERVED_KEYWORDS = frozenset({"prompts", "completions"})
#: Largest float32: a reward beyond it would become ±inf in the [N] float32 reward tensor.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class _Unscored:
    """The type of :data:`UNSCORED` (one instance; pickled by name, so it stays the same object)."""

    def __repr__(self) -> str:
        return "UNSCORED"

    def __reduce__(self) -> str:
        return "UNSCORED"


#: What a reward returns for a row it applies to but could not score (the verifier, its service or sandbox failed):
#: an infrastructure failure of that row even where another weighted reward scores it. None means "does not apply".
UNSCORED = _Unscored()


class RewardError(RuntimeError):
    """A reward function cannot be used, raised, or broke its contract; the message names it and where it is
    defined (file:line)."""


class RewardOutputError(RewardError, ValueError):
    """A reward function returned the wrong number of values or something that is not a number or None."""


def where_defined(fn: Callable) -> str:
    """``path/file.py:LINE`` of the function's definition (through ``functools.partial`` and decorators), else its
    repr."""
    target = inspect.unwrap(getattr(fn, "func", fn))
    try:
        path = inspect.getsourcefile(target) or inspect.getfile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return repr(fn)
    return f"{path}:{line}"


@dataclass(frozen=True)
class RewardSignature:
    """How to call one reward function.

    Attributes:
        style: ``"references"`` (``fn(completions, references)``) or ``"row"`` (keywords).
        accepts: the keywords a whole-row function takes; None when it takes any (``**kwargs``).
        required: keywords without a default besides ``prompts`` and ``completions``: columns every row must have.
    """

    style: Literal["references", "row"]
    accepts: frozenset[str] | None = None
    required: frozenset[str] = frozenset()

    def keywords(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``available`` this function takes."""
        if self.accepts is None:
            return dict(available)
        return {k: v for k, v in available.items() if k in self.accepts}


def _is_references_style(params: list[inspect.Parameter]) -> bool:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if len(required) != 2 or any(p.kind not in positional for p in required):
        return False
    first, second = (p.name for p in required)
    return "prompts" not in (first, second) and not (first == "completions" and second != "references")


@lru_cache(maxsize=512)
def _signature(fn: Callable) -> RewardSignature:
    """:func:`signature_of` without the name in messages; raises ValueError(reason)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its signature cannot be read ({exc})") from None
    if _is_references_style(params):
        return RewardSignature(REFERENCES)
    if any(p.kind == inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty for p in params):
        names = [p.name for p in params if p.kind == inspect.Parameter.POSITIONAL_ONLY]
        raise ValueError(f"positional-only parameters {names} cannot receive the keywords rewards are called with")
    var_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if not var_keyword and "completions" not in {p.name for p in named}:
        raise ValueError("expected fn(prompts, completions, **columns) (a parameter named 'completions', or "
                         "**kwargs) or fn(completions, references); got parameters "
                         f"({', '.join(str(p) for p in params)})")
    required = frozenset(p.name for p in named if p.default is inspect.Parameter.empty) - RESERVED_KEYWORDS
    return RewardSignature(WHOLE_ROW, None if var_keyword else frozenset(p.name for p in named), required)


def signature_of(fn: Callable, name: str) -> RewardSignature:
    """The calling convention of reward ``name`` (module docstring).

    Raises:
        RewardError: the function cannot be called either way (no parameter ``completions`` nor ``**kwargs``,
            required positional-only parameters, an unreadable signature); the message names ``name`` and
            :func:`where_defined`.
    """
    if not callable(fn):
        raise RewardError(f"reward function {name!r} is not callable: {fn!r}")
    try:
        try:
            return _signature(fn)
        except TypeError:  # an unhashable callable object: not cached
            return _signature.__wrapped__(fn)
    except ValueError as exc:
        raise RewardError(f"reward function {name!r} ({where_defined(fn)}) has an unusable signature: {exc}") \
            from None


def run_awaitable(value: Any) -> Any:
    """``value`` itself, or, when it is awaitable (an ``async def`` function's coroutine), its result: run with
    :func:`asyncio.run`, or in a helper thread with its own event loop when this thread already runs one."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-async") as pool:
        return pool.submit(asyncio.run, wait()).result()


def call_reward(fn: Callable, signature: RewardSignature, completions: Sequence[str], references: Sequence[str],
                prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]) -> Any:
    """Call ``fn`` on N rows with its convention (module docstring) and return what it returned (awaited when it is
    async); the caller checks the values (:func:`values_to_tensor`). Exceptions of ``fn`` propagate."""
    if signature.style == REFERENCES:
        return run_awaitable(fn(list(completions), list(references)))
    available = {**{k: list(v) for k, v in columns.items()}, "prompts": list(prompts),
                 "completions": list(completions)}
    return run_awaitable(fn(**signature.keywords(available)))


def _finite(name: str, where: str, row: int, value: Real) -> float:
    """``value`` as a float; NaN stays NaN (no score).

    Raises:
        RewardOutputError: ±inf, or a number beyond float32's range (it would become ±inf in the reward tensor).
    """
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if math.isinf(number) or abs(number) > _FLOAT32_MAX:
        raise RewardOutputError(f"reward function {name!r} returned {value!r:.40} at row {row}, expected a finite "
                                f"number (within float32's range) or None for no score (defined at {where})")
    return number


def unscored_rows(values: object) -> list[bool]:
    """Which of a reward function's values are :data:`UNSCORED` (its verifier could not score the row); all False
    for values that cannot hold it (a numpy array or tensor of numbers)."""
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()
    return [v is UNSCORED for v in values] if isinstance(values, Sequence) else []


def values_to_tensor(name: str, fn: Callable, values: object, n: int) -> torch.Tensor:
    """A reward function's N values as a [N] float32 tensor, NaN for None and :data:`UNSCORED` (and for NaN: no
    score; :func:`unscored_rows` tells UNSCORED apart).

    Accepts any sequence (or an object with ``tolist()``, e.g. a numpy array or tensor) of real numbers (ints and bools
    count), None and UNSCORED.

    Raises:
        RewardOutputError: not a sequence, not N values, a value that is neither a real number nor None, or ±inf (or
            a number float32 rounds to ±inf); naming ``name``, :func:`where_defined` and the row.
    """
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()
    where = where_defined(fn)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardOutputError(f"reward function {name!r} must return a sequence of {n} values, got "
                                f"{type(values).__name__} (defined at {where})")
    if len(values) != n:
        raise RewardOutputError(f"reward function {name!r} returned {len(values)} values, expected {n} (one per "
                                f"completion; defined at {where})")
    out = []
    for i, v in enumerate(values):
        if v is None or v is UNSCORED:
            out.append(math.nan)
        elif isinstance(v, Real):
            out.append(_finite(name, where, i, v))
        else:
            raise RewardOutputError(f"reward function {name!r} returned {type(v).__name__} at row {i}, expected float "
                                    f"or None (defined at {where})")
    return torch.tensor(out, dtype=torch.float32)
