"""How a spec problem is reported: where its value was written, one line per problem under one header.

- :func:`where` says where a field's value came from: the ``--set`` that gave it (or a section above it, or keys
  inside it), else its YAML ``file:line``, else its nearest parent's line.
- :func:`problem_line` writes ``<where>: <dotted.field>: <message>``, naming the field once: when the ``--set`` key is
  the field itself (``--set train.lr: Input should be a valid number (got 'abc')``) it is not repeated.
- :func:`format_errors` turns a pydantic ``ValidationError`` into one header (``job.yaml: invalid job spec (2
  problems):``) and those lines. A cross-field conflict (:class:`cluster.spec.algorithm.FieldConflict`) is blamed on
  the ``--set`` of any field it involves (:func:`involved_fields`), since that override made the spec inconsistent;
  only when none came from ``--set`` does it point at the conflict field's line in the file.
- :func:`unknown_key_message` adds the closest allowed key (:func:`did_you_mean`, ``difflib``) to every unknown-key
  message, at any nesting level, in YAML files and in ``--set``.

Imports only pydantic, the standard library and :mod:`cluster.spec.job` (the model tree walked by :func:`model_at`).
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from cluster.spec.algorithm import FieldConflict
from cluster.spec.job import JobSpec

__all__ = ["Loc", "did_you_mean", "format_errors", "involved_fields", "model_at", "problem_line",
           "unknown_key_message", "where"]

Loc = tuple[str, ...]
_DOTTED = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+\b")
_WORD = re.compile(r"\b[a-z_][a-z0-9_]*\b")


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``value`` (:func:`difflib.get_close_matches`, cutoff 0.6,
    letter case ignored), or ``""`` when none is that close."""
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def unknown_key_message(key: str, allowed: Sequence[str], level: str = "") -> str:
    """``unknown key 'group_sise'[ at rollout] (did you mean 'group_size'?); allowed: replicas, ...``."""
    at = f" at {level}" if level else ""
    return f"unknown key {key!r}{at}{did_you_mean(key, allowed)}; allowed: {', '.join(allowed)}"


def model_at(loc: Sequence[str]) -> type[BaseModel] | None:
    """The spec model class found by walking field names from JobSpec, or None if loc leaves the models. An
    optional section (``eval: EvalSpec | None``) counts as its model."""
    cls: type[BaseModel] = JobSpec
    for part in loc:
        field = cls.model_fields.get(part)
        ann = field.annotation if field is not None else None
        if isinstance(ann, types.UnionType):
            ann = next((a for a in ann.__args__ if a is not type(None)), None) if len(ann.__args__) == 2 else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _is_field(loc: Loc) -> bool:
    """Whether ``loc`` names a field of the spec (a leaf or a section)."""
    parent = model_at(loc[:-1]) if loc else None
    return parent is not None and loc[-1] in parent.model_fields


def involved_fields(conflict: FieldConflict) -> list[Loc]:
    """The fields a cross-field conflict involves: its own field, every dotted spec field its message names
    (``rollout.max_response_tokens``), and the bare names of its own section's fields that the message uses
    (``max_staleness`` in a ``rollout.*`` conflict)."""
    own: Loc = tuple(conflict.field.split("."))
    out = [own]
    text = str(conflict)
    for dotted in _DOTTED.findall(text):
        loc = tuple(dotted.split("."))
        if _is_field(loc) and loc not in out:
            out.append(loc)
    section = model_at(own[:-1])
    if section is not None:
        for word in _WORD.findall(text):
            loc = (*own[:-1], word)
            if word in section.model_fields and loc not in out:
                out.append(loc)
    return out


def where(loc: Loc, source: str, lines: Mapping[Loc, int], set_by: Mapping[Loc, str]) -> str:
    """Where loc's value came from, most specific first: an override of loc or a parent (``--set key``); else
    overrides of keys inside loc (``--set algorithm.rewards.nope=1`` for an error at ``algorithm.rewards``); else
    loc's YAML line, or its nearest parent's."""
    overrides = _overrides_of(loc, set_by)
    if overrides:
        return ", ".join(f"--set {key}" for key in overrides)
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return f"{source}:{lines[loc[:end]]}"
    return source


def _overrides_of(loc: Loc, set_by: Mapping[Loc, str]) -> list[str]:
    """The ``--set`` keys that gave loc's value: the override of loc or of a section above it, else those of keys
    inside it; empty when none did."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in set_by:
            return [set_by[loc[:end]]]
    return [key for set_loc, key in set_by.items() if loc and set_loc[:len(loc)] == loc]


def problem_line(place: str, loc: Loc, message: str) -> str:
    """``<place>: <field>: <message>``, without the field when ``place`` is ``--set <field>`` (named once)."""
    field = ".".join(loc) or "<spec>"
    return f"{place}: {message}" if place == f"--set {field}" else f"{place}: {field}: {message}"


def format_errors(exc: ValidationError, source: str, lines: Mapping[Loc, int], set_by: Mapping[Loc, str]) -> str:
    """One header and one ``<where>: <dotted.field>: <message> (got <value>)`` line per pydantic error."""
    out = []
    for err in exc.errors():
        loc: Loc = tuple(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        cause = (err.get("ctx") or {}).get("error")
        show_value = err["type"] not in ("missing", "extra_forbidden", "value_error")  # our messages name it
        place = None
        if isinstance(cause, FieldConflict):
            loc, msg, show_value = tuple(cause.field.split(".")), str(cause), False
            blamed = [key for involved in involved_fields(cause) for key in _overrides_of(involved, set_by)]
            place = ", ".join(f"--set {key}" for key in dict.fromkeys(blamed)) or None
            if place and not _overrides_of(loc, set_by) and loc in lines:  # the other side was written in the file
                place = f"{place}: {'.'.join(loc)} (written at {source}:{lines[loc]})"
                out.append(f"{place}: {msg}")
                continue
        elif err["type"] == "extra_forbidden":
            cls = model_at(loc[:-1])
            msg = unknown_key_message(loc[-1], list(cls.model_fields) if cls is not None else [])
        elif err["type"] == "missing":
            msg = f"required key {loc[-1]!r} is missing"
        elif err["type"] == "string_too_short" and (err.get("ctx") or {}).get("min_length") == 1:
            msg, show_value = empty_string_message(loc), False
        got = f" (got {_short_repr(err['input'])})" if show_value else ""
        out.append(problem_line(place or where(loc, source, lines, set_by), loc, msg + got))
    header = f"{source}: invalid job spec ({len(out)} problem{'s' if len(out) != 1 else ''}):"
    return "\n".join([header, *("  " + line for line in out)])


def empty_string_message(loc: Loc) -> str:
    """What an empty string in a field that needs text means: for an optional field (a path, an address, a host),
    that the default is written null or left out — ``""`` is never taken as the default."""
    cls = model_at(loc[:-1]) if loc else None
    field = cls.model_fields.get(loc[-1]) if cls is not None else None
    optional = field is not None and not field.is_required()
    return "empty string: expected a non-empty value" + (
        " (for the default, write null or leave the key out)" if optional else "")


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
