"""What a reward function needs of every data row, checked when the data is loaded (before any worker starts), and
only for the rewards a job uses: a row is never refused for a format no reward asked for.

A reward declares its own check as a ``check_row`` attribute (``register_reward_function(name, check_row=...)``, or
``fn.check_row = check`` for a function named in the spec). The check gets one row and raises ``ValueError`` with the
reason when the reward cannot score it; what it gets follows the reward's convention (``grpo.rewards.calling``):

- a ``(completions, references)`` reward's check is called ``check_row(reference)`` with the row's reference (the
  answer column, the text after its last ``####`` when it has one); the row must have the answer column;
- a whole-row reward's check is called with keywords: ``prompt`` (the row's prompt as given) and one per column
  (that row's value), only those its parameters name (all with ``**kwargs``).

Whole-row rewards are also checked without a ``check_row``: each parameter without a default (besides ``prompts`` and
``completions``) must be a column of every row, and no column may be named ``prompts`` or ``completions``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from grpo.rewards.calling import REFERENCES, RESERVED_KEYWORDS, RewardSignature, signature_of, where_defined

__all__ = ["RowCheck", "row_checks"]


@dataclass(frozen=True)
class RowCheck:
    """The load-time check of one reward a job uses.

    Attributes:
        name: the reward's name (a key of ``algorithm.rewards``, or ``eval.accuracy_reward``...).
        field: the spec field that names it, for messages (``algorithm.rewards``).
        signature: the reward's calling convention.
        check: its declared ``check_row``, or None.
        where: where the reward function is defined (file:line).
    """

    name: str
    field: str
    signature: RewardSignature
    check: Callable[..., Any] | None
    where: str

    @property
    def needs_reference(self) -> bool:
        """A ``(completions, references)`` reward with a declared check: the row must have the answer column."""
        return self.signature.style == REFERENCES and self.check is not None

    def __call__(self, prompt: Any, columns: Mapping[str, Any], reference: str | None) -> None:
        """Check one row: its prompt as given, its other columns, and its reference (None: no answer column).

        Raises:
            ValueError: why reward ``name`` cannot score the row (no location; the loader adds file and line).
        """
        if self.signature.style == REFERENCES:
            if self.check is None:
                return
            if reference is None:
                raise ValueError("it reads the answer column (data.answer_field) as its reference, which the row "
                                 "lacks")
            self._run(self.check, (reference,), {})
            return
        clash = sorted(RESERVED_KEYWORDS & set(columns))
        if clash:
            raise ValueError(f"column {clash[0]!r} has the name of a keyword every whole-row reward is called with "
                             f"(prompts, completions); rename the column")
        missing = sorted(self.signature.required - set(columns))
        if missing:
            near = difflib.get_close_matches(missing[0], list(columns), n=1)
            hint = f"; did you mean column {near[0]!r}?" if near else ""
            raise ValueError(f"its function ({self.where}) takes {', '.join(map(repr, missing))} without a default, "
                             f"but the row has no such column (its columns besides the prompt: "
                             f"{sorted(columns) or 'none'}{hint}); add the column or give the parameter a default")
        if self.check is not None:
            values = {**columns, "prompt": prompt}
            accepts = _keywords_taken(self.check)
            self._run(self.check, (), values if accepts is None else {k: v for k, v in values.items() if k in accepts})

    def _run(self, check: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            check(*args, **kwargs)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a check that breaks is reported like a refusal, with its cause
            raise ValueError(f"its check_row ({where_defined(check)}) raised {type(exc).__name__}: {exc}") from None


def _keywords_taken(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword parameters of ``fn``; None when it takes ``**kwargs`` (or its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY))


def row_checks(uses: Mapping[str, str]) -> tuple[RowCheck, ...]:
    """The checks of the rewards a job uses.

    Args:
        uses: reward name (registered in ``grpo.rewards.REWARD_FUNCTIONS``) → the spec field naming it
            (``{"accuracy": "algorithm.rewards", "format": "eval.format_reward"}``).

    Raises:
        ValueError: an unknown name. RewardError: a function with an unusable signature.
    """
    from grpo.rewards import REWARD_FUNCTIONS

    out = []
    for name, field in uses.items():
        fn = REWARD_FUNCTIONS.lookup(name)
        out.append(RowCheck(name, field, signature_of(fn, name), getattr(fn, "check_row", None), where_defined(fn)))
    return tuple(out)
