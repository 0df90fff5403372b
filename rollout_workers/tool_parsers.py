"""Tool-call parsers: a completion's text -> its content and tool calls, in the model's own format (the agent
endpoint's ``tool_calls``, ``rollout.endpoint.tool_parser``).

Names:

- ``hermes`` (built in, pure Python): Hermes/Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  the format SmolLM2 and Qwen2.5/Qwen3 use, read by :func:`grpo.environments.tool_calls.parse_tool_calls` (the
  ``tools`` environment's parser). Available where vLLM is not installed.
- ``vllm:<name>``: vLLM's own parser of that name (``vllm:hermes``, ``vllm:llama3_json``, ``vllm:mistral``,
  ``vllm:qwen3_coder``, ...; ``vllm.tool_parsers.ToolParserManager``), loaded from ``rollout_workers/vllm/`` the
  first time one is named (importing vLLM takes seconds), so only where vLLM is installed.
- your own: ``@register_tool_parser("NAME")`` on a function ``tokenizer -> ToolCallParser`` in a module imported
  before the spec is validated (``grpo-cluster run --import MODULE``).

Every parser follows vLLM's non-streaming rule: when every call in the text reads, the text before the first call is
the content (None when empty) and the calls are the tool calls; when one does not read, there are no tool calls and
the whole text is the content (the agent sees what the model wrote). A parser must not raise for the model's text.
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo.environments.tool_calls import CALL_OPEN, ToolCall, parse_tool_calls

__all__ = [
    "FAMILIES", "TOOL_PARSERS", "HermesToolParser", "ParsedCall", "ParsedTurn", "ToolCallParser",
    "build_tool_parser", "check_tool_parser", "register_tool_parser", "tool_parser_names",
]


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedTurn:
    """A completion read for tool calls: ``content`` (None when empty) and ``calls`` in order ([] when none)."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Reads the tool calls of one completion's text (module docstring)."""

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ParsedTurn:
        """``text``: the completion decoded (special tokens kept, the end-of-turn token dropped); ``tools``: the
        call's OpenAI ``tools`` list (None when it gave none). Never raises for the model's text."""
        ...


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` calls (module docstring); ``tools`` is not needed to read them."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ParsedTurn:
        found = parse_tool_calls(text)
        if not found or not all(isinstance(call, ToolCall) for call in found):
            return ParsedTurn(text or None)
        content = text[:text.find(CALL_OPEN)]
        return ParsedTurn(content or None, [ParsedCall(c.name, json.dumps(c.arguments, ensure_ascii=False))
                                            for c in found])


#: name -> a function ``tokenizer -> ToolCallParser`` (built-in and registered parsers).
TOOL_PARSERS: dict[str, Callable[[Any], ToolCallParser]] = {"hermes": HermesToolParser}
#: name prefix -> the module serving ``<prefix>:<name>``: it defines ``names() -> list[str]`` and
#: ``build(name, tokenizer) -> ToolCallParser`` and is imported the first time such a name is checked or built.
FAMILIES: dict[str, str] = {"vllm": "rollout_workers.vllm.tool_parsers"}


def register_tool_parser(name: str) -> Callable:
    """Decorator: register ``factory(tokenizer) -> ToolCallParser`` under ``name``.

    Raises:
        ValueError: the name is taken, or it has a family's prefix (``vllm:``).
    """
    def add(factory: Callable[[Any], ToolCallParser]) -> Callable[[Any], ToolCallParser]:
        if name in TOOL_PARSERS:
            raise ValueError(f"tool parser {name!r} is already registered ({TOOL_PARSERS[name]!r})")
        if name.partition(":")[0] in FAMILIES and ":" in name:
            raise ValueError(f"tool parser names starting with {name.partition(':')[0]!r}: are served by "
                             f"{FAMILIES[name.partition(':')[0]]}; register {name!r} under another name")
        TOOL_PARSERS[name] = factory
        return factory
    return add


def _family(name: str):
    """The module serving ``name``'s family, or None for a plain name. Raises ImportError when it cannot load."""
    prefix, colon, _ = name.partition(":")
    if not colon or prefix not in FAMILIES:
        return None
    return importlib.import_module(FAMILIES[prefix])


def tool_parser_names() -> list[str]:
    """The plain names registered now, sorted, then ``<family>:*`` for each family (their names are listed by
    :func:`check_tool_parser` when one is asked for)."""
    return sorted(TOOL_PARSERS) + [f"{prefix}:*" for prefix in sorted(FAMILIES)]


def check_tool_parser(name: str) -> str | None:
    """None when ``name`` can be built here, else one line saying why (the names there are, what is missing)."""
    if name in TOOL_PARSERS:
        return None
    prefix = name.partition(":")[0]
    try:
        family = _family(name)
    except ImportError as exc:
        return (f"tool parser {name!r} needs {prefix} installed here ({type(exc).__name__}: {exc}); built in: "
                f"{', '.join(sorted(TOOL_PARSERS))}")
    if family is None:
        return (f"unknown tool parser {name!r}{_did_you_mean(name, list(TOOL_PARSERS))}; expected one of "
                f"{', '.join(tool_parser_names())} (register one with @register_tool_parser(\"NAME\") from "
                f"rollout_workers.tool_parsers in a module imported before the spec is validated)")
    known = [f"{prefix}:{n}" for n in family.names()]
    if name in known:
        return None
    return f"unknown tool parser {name!r}{_did_you_mean(name, known)}; {prefix} has: {', '.join(known)}"


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def build_tool_parser(name: str, tokenizer) -> ToolCallParser:
    """The parser ``name`` for ``tokenizer``.

    Raises:
        ValueError: :func:`check_tool_parser`'s reason.
    """
    problem = check_tool_parser(name)
    if problem is not None:
        raise ValueError(problem)
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name](tokenizer)
    return _family(name).build(name.partition(":")[2], tokenizer)
