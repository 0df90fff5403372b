"""vLLM's own tool-call parsers behind ``rollout.endpoint.tool_parser: vllm:<name>`` (imports vLLM, starts no
engine: listed in tests/conftest.py's NO_ENGINE): ``vllm:hermes`` reads what the built-in ``hermes`` reads, the same
way, a parser that cannot read the text leaves it as content without raising, another format (``vllm:pythonic``)
is served by the same registry, and a parser that does not fit the model's tokenizer is refused when built."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from rollout_workers.tool_parsers import build_tool_parser, check_tool_parser  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", [
    "Let me add. " + CALL, CALL + "\n" + CALL.replace("2 + 3", "7 * 6"), "No call here.",
    CALL.replace('{"expression"', '{expression'),  # does not read: all of it stays content
])
def test_agent_vllm_hermes_parser_reads_as_the_builtin_does(tokenizer, text):
    ours = build_tool_parser("hermes", tokenizer).parse(text, TOOLS)
    theirs = build_tool_parser("vllm:hermes", tokenizer).parse(text, TOOLS)
    assert theirs.content == ours.content
    assert [(c.name, json.loads(c.arguments)) for c in theirs.calls] == \
        [(c.name, json.loads(c.arguments)) for c in ours.calls]


def test_agent_vllm_parsers_by_name(tokenizer):
    assert check_tool_parser("vllm:llama3_json") is None
    assert "did you mean 'vllm:hermes'?" in check_tool_parser("vllm:hermez")
    turn = build_tool_parser("vllm:pythonic", tokenizer).parse('[calculator(expression="1 + 1")]', TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("calculator", {"expression": "1 + 1"})]
    assert build_tool_parser("vllm:pythonic", tokenizer).parse("[not python(", TOOLS).calls == []
    with pytest.raises(ValueError, match=r"rollout.endpoint.tool_parser: vllm:llama3_json does not fit this "
                                         r"model's tokenizer \(RuntimeError: .*<\|python_tag\|>"):
        build_tool_parser("vllm:llama3_json", tokenizer)
