"""Tool calls in a policy turn, in the documented default format::

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>

(Hermes/Qwen's format: one JSON object per call between the tags, ``name`` a string and ``arguments`` an object, or
a string holding one.) :func:`parse_tool_calls` finds every call of a turn, in order; a call that cannot be read
comes back as a :class:`CallError` with what is wrong, which the tool environment shows the policy as its
observation (the policy's mistake, not an infrastructure failure). Pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CALL_CLOSE", "CALL_OPEN", "CallError", "ToolCall", "parse_tool_calls"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A call that cannot be read: ``message`` says why, ``text`` is what was between the tags (shortened)."""

    message: str
    text: str


def _shorten(text: str, limit: int = 120) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _read_call(body: str) -> ToolCall | CallError:
    """One call's JSON (module docstring)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return CallError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})", _shorten(body))
    except RecursionError:
        return CallError("the tool call's JSON is nested too deeply", _shorten(body))
    if not isinstance(value, dict):
        return CallError(f"expected a JSON object with \"name\" and \"arguments\", got {type(value).__name__}",
                         _shorten(body))
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return CallError("the tool call has no \"name\" string", _shorten(body))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return CallError(f"\"arguments\" of {name!r} is a string that is not a JSON object", _shorten(body))
    if not isinstance(arguments, dict):
        return CallError(f"\"arguments\" of {name!r} must be a JSON object, got {type(arguments).__name__}",
                         _shorten(body))
    try:
        where = _unencodable(arguments)
    except RecursionError:
        return CallError("the tool call's JSON is nested too deeply", _shorten(body))
    if where is not None:
        return CallError(f"\"arguments\" of {name!r} hold text that is not valid Unicode (a lone surrogate escape "
                         f"such as \\ud800 at {where})", _shorten(body))
    return ToolCall(name, arguments)


def _unencodable(value: Any, where: str = "arguments") -> str | None:
    """Where in a decoded JSON value a string (key or value) cannot be encoded as UTF-8 (JSON's ``\\uD800`` escapes
    decode to lone surrogates), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _unencodable(key, f"{where} (a key)") if isinstance(key, str) else None
        found = found or _unencodable(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
    """Every ``<tool_call>...</tool_call>`` of a turn, in order, read (:class:`ToolCall`) or not (:class:`CallError`);
    an opening tag left unclosed at the end of the turn (a turn cut at its token cap) is a :class:`CallError` too.
    [] when the turn calls no tool."""
    out: list[ToolCall | CallError] = [_read_call(m.group(1)) for m in _CALL.finditer(text)]
    tail = text[text.rfind(CALL_CLOSE) + len(CALL_CLOSE):] if CALL_CLOSE in text else text
    if CALL_OPEN in tail:
        out.append(CallError(f"{CALL_OPEN} without {CALL_CLOSE}", _shorten(tail[tail.index(CALL_OPEN):])))
    return out
