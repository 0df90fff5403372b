"""vLLM's own tool-call parsers behind ``rollout_workers.tool_parsers`` (``rollout.endpoint.tool_parser:
vllm:<name>``): the model's format read by the code vLLM's OpenAI server reads it with.

``vllm.tool_parsers.ToolParserManager`` holds the names (``hermes``, ``llama3_json``, ``mistral``, ``qwen3_coder``,
...; vLLM 0.32). A parser is built per completion (vLLM's parsers keep streaming state) with the call's ``tools``
validated as vLLM's ``ChatCompletionRequest`` does, and its ``extract_tool_calls`` (the non-streaming path) gives the
content and the calls. A parser that cannot read the text returns it as content (vLLM's rule); the traceback vLLM
logs then is silenced (the endpoint's rule: the model's text is never an error), as is any exception a parser raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

from rollout_workers.tool_parsers import ParsedCall, ParsedTurn

__all__ = ["VllmToolParser", "build", "names"]


def names() -> list[str]:
    """vLLM's tool-parser names, sorted."""
    return ToolParserManager.list_registered()


class VllmToolParser:
    """vLLM's parser ``name`` (a :class:`rollout_workers.tool_parsers.ToolCallParser`).

    Raises:
        KeyError: vLLM has no parser of that name.
        ValueError: the parser does not fit the model's tokenizer (it looks for tokens the vocabulary lacks, e.g.
            ``llama3_json``'s ``<|python_tag|>``): raised when the endpoint is built, naming the field.
    """

    def __init__(self, name: str, tokenizer):
        self.name, self.tokenizer = name, tokenizer
        self.parser_class = ToolParserManager.get_tool_parser(name)
        try:
            self.parser_class(tokenizer, None)
        except Exception as exc:  # vLLM's parsers raise RuntimeError/ValueError for a tokenizer they cannot read
            raise ValueError(f"rollout.endpoint.tool_parser: vllm:{name} does not fit this model's tokenizer "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        logging.getLogger(self.parser_class.__module__).setLevel(logging.CRITICAL)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ParsedTurn:
        try:
            request = ChatCompletionRequest(messages=[], model="agent", tools=list(tools) if tools else None)
            parser = self.parser_class(self.tokenizer, request.tools)
            info = parser.extract_tool_calls(text, request)
        except Exception:  # the endpoint's rule: the model's text is never an error (module docstring)
            return ParsedTurn(text or None)
        if not info.tools_called:
            return ParsedTurn(text or None)
        calls = [ParsedCall(c.function.name, c.function.arguments) for c in info.tool_calls]
        return ParsedTurn(info.content or None, calls)


def build(name: str, tokenizer) -> VllmToolParser:
    """:class:`VllmToolParser` ``name`` for ``tokenizer``."""
    return VllmToolParser(name, tokenizer)
