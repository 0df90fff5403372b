"""Tool-call parsers for the agent endpoint (``rollout_workers.tool_parsers``): the built-in Hermes parser on the
formats a model writes (calls with content before them, several calls, arguments as a JSON string, a call that
does not read or is left open: the whole text stays content), the registry's refusals, and
``rollout.endpoint.tool_parser`` checked when the spec is validated, naming the field."""

from __future__ import annotations

import json

import pytest

from cluster.spec import SpecError, load_spec_text
from rollout_workers.tool_parsers import (TOOL_PARSERS, HermesToolParser, ParsedCall, ParsedTurn, build_tool_parser,
                                          check_tool_parser, register_tool_parser)

SPEC = """\
output_dir: runs/test
total_steps: 1
data: {train_path: train.jsonl}
rollout:
  endpoint:
    tool_parser: hermes
"""


def hermes(text: str) -> ParsedTurn:
    return HermesToolParser().parse(text, None)


def test_agent_tool_parser_hermes_reads_calls_in_the_model_format():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    assert hermes("Let me add. " + call) == ParsedTurn("Let me add. ", [ParsedCall("calculator",
                                                                                   '{"expression": "2 + 3"}')])
    two = hermes(call + "\n" + call.replace("2 + 3", "7"))
    assert two.content is None and [json.loads(c.arguments)["expression"] for c in two.calls] == ["2 + 3", "7"]
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert hermes(as_string).calls == [ParsedCall("f", '{"x": 1}')]
    assert hermes("Just text.") == ParsedTurn("Just text.") and hermes("") == ParsedTurn(None)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>',  # one does not read
    'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}',  # left open (cut at the token cap)
    '<tool_call>["f"]</tool_call>',
])
def test_agent_tool_parser_hermes_leaves_unreadable_calls_in_the_content(text):
    assert hermes(text) == ParsedTurn(text)


def test_agent_tool_parser_registry_refuses_clearly():
    assert check_tool_parser("hermes") is None and isinstance(build_tool_parser("hermes", None), HermesToolParser)
    assert "unknown tool parser 'herme' (did you mean 'hermes'?)" in check_tool_parser("herme")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes")(HermesToolParser)
    with pytest.raises(ValueError, match="are served by rollout_workers.vllm.tool_parsers"):
        register_tool_parser("vllm:mine")(HermesToolParser)
    register_tool_parser("agent_test_parser")(HermesToolParser)
    try:
        assert load_spec_text(SPEC.replace("hermes", "agent_test_parser")).rollout.endpoint.tool_parser \
            == "agent_test_parser"
    finally:
        del TOOL_PARSERS["agent_test_parser"]


def test_agent_endpoint_spec_section_defaults_and_refusals():
    endpoint = load_spec_text(SPEC).rollout.endpoint
    assert (endpoint.host, endpoint.port, endpoint.advertise_host, endpoint.max_call_tokens,
            endpoint.rewritten_history, endpoint.wildcard) == ("127.0.0.1", 0, None, None, "split", False)
    with pytest.raises(SpecError) as info:
        load_spec_text(SPEC.replace("hermes", "hermez"))
    assert "rollout.endpoint.tool_parser" in str(info.value) and "did you mean 'hermes'?" in str(info.value)
    assert "<string>:6: rollout.endpoint.tool_parser" in str(info.value)
    with pytest.raises(SpecError, match="rollout.endpoint.host: .*no scheme"):
        load_spec_text(SPEC, overrides=("rollout.endpoint.host=http://0.0.0.0",))
    with pytest.raises(SpecError, match="rollout.endpoint.rewritten_history"):
        load_spec_text(SPEC, overrides=("rollout.endpoint.rewritten_history=drop",))
    assert load_spec_text(SPEC, overrides=("rollout.endpoint.host=0.0.0.0",)).rollout.endpoint.wildcard
