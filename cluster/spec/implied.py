"""Settings a spec's choice implies when the spec leaves them out, and which of a validated spec's values were implied.

A choice can bring companion settings whose plain defaults belong to another choice: a sequence-level policy loss
clips a sequence's ratio, whose paper range is far narrower than the token-level 0.2 (``policy_loss: gspo`` implies
GSPO's ``clip_eps_low`` 3e-4 and ``clip_eps_high`` 4e-4); ``rollout.mode: async`` implies ``max_staleness: 1``. A
section with such settings declares a :data:`Rule` as its ``IMPLIED`` class attribute and validates through
:func:`with_implied` in a ``mode="wrap"`` model validator: the rule maps the section's values (the raw data, or a
validated section's values) to ``{field: (value, why)}`` for the settings its choices imply; those the data leaves out
are filled in before validation and left out of the validated section's ``model_fields_set``, so that
:func:`implied_settings` tells them from the values the spec gave. A value the spec gives is always kept (and checked
as written). A rule key may be dotted (``algorithm.rewards``) for a setting of a sub-section the section's choice
implies (``data.source: reasoning_gym`` at the job's level).

A spec written back with ``spec_to_yaml`` gives every value, so a spec read from it has nothing implied: the values
in force are the same.

Imports only pydantic and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel

__all__ = ["Implied", "Rule", "implied_settings", "with_implied"]

#: A section's values → ``{field: (implied value, why)}`` for the settings its choices imply (dotted for a
#: sub-section's). Must not raise on raw, not yet validated data: it skips what it cannot read.
Rule = Callable[[Mapping[str, Any]], dict[str, tuple[Any, str]]]


class Implied(NamedTuple):
    """One setting in force because a choice implied it: ``field`` (dotted from the job root), its ``value``, and
    ``why`` (the choice and its source)."""

    field: str
    value: Any
    why: str


def _missing(data: Mapping[str, Any], key: str) -> bool:
    """Whether dotted ``key`` is left out of ``data``: its sub-section is left out or is a mapping without it (a
    sub-section given as something else, null included, is left alone)."""
    head, _, rest = key.partition(".")
    if not rest:
        return head not in data
    block = data.get(head, {})
    return isinstance(block, Mapping) and rest not in block


def _filled(data: Mapping[str, Any], implied: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """``data`` with the implied values set (a left-out sub-section made a mapping of them)."""
    out = dict(data)
    for key, (value, _) in implied.items():
        head, _, rest = key.partition(".")
        out[head] = {**out.get(head, {}), rest: value} if rest else value
    return out


def with_implied(data: Any, handler: Callable[[Any], BaseModel], rule: Rule) -> BaseModel:
    """The body of a section's ``mode="wrap"`` model validator: ``rule``'s settings that ``data`` leaves out are
    filled in, the section is validated by ``handler``, and the filled-in fields are left out of its
    ``model_fields_set`` (a sub-section's, for a dotted key). Anything but a mapping (a section already built) is
    validated as it is."""
    if not isinstance(data, Mapping):
        return handler(data)
    implied = {key: pair for key, pair in rule(data).items() if _missing(data, key)}
    section = handler(_filled(data, implied))
    for key in implied:
        head, _, rest = key.partition(".")
        owner = getattr(section, head) if rest else section
        if isinstance(owner, BaseModel):
            owner.model_fields_set.discard(rest or head)
    return section


def _given(section: BaseModel) -> dict[str, Any]:
    """A validated section's values as its rule reads raw data: the fields the spec gave (a sub-section's as a
    mapping of the fields it gave)."""
    out = {}
    for name in section.model_fields_set:
        value = getattr(section, name)
        out[name] = _given(value) if isinstance(value, BaseModel) else value
    return out


def implied_settings(section: BaseModel, prefix: str = "") -> list[Implied]:
    """Every setting of ``section`` and its sub-sections in force because a choice implied it (the section's
    ``IMPLIED`` rules), in field order; values the spec gave are not listed.

    Args:
        section: a validated spec (or section). prefix: its dotted path from the job root ("" for the job).
    """
    out: list[Implied] = []
    rule: Rule | None = getattr(type(section), "IMPLIED", None)
    if rule is not None:
        given = _given(section)
        for key, (_, why) in rule(given).items():
            if _missing(given, key):
                head, _, rest = key.partition(".")
                value = getattr(getattr(section, head), rest) if rest else getattr(section, head)
                out.append(Implied(f"{prefix}{key}", value, why))
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out += implied_settings(value, f"{prefix}{name}.")
    return out
