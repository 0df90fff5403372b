"""The agent endpoint given what a buggy or hostile agent sends: each refusal is an OpenAI error the ``openai``
client raises at once (no retries, no traceback in the message), a one-line reason in ``EpisodeRecord.refused``, and
the endpoint keeps serving every other episode. Kinds: a call after the episode closed, a URL of no episode, a prompt
over the episode's budget, a rewritten history when the spec refuses them, malformed bodies (not JSON, streaming,
n > 1, image parts, unknown roles, bad tool calls), a template that fails on the messages, an engine that fails or
aborts, and a bug of ours (an internal error)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from cluster.endpoint import ChatEndpoint, EndpointSettings
from tests.request_server_stub import ScriptedRequestServer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def started(tokenizer):
    """(endpoint, engine): an endpoint whose engine answers every call with "Fine." and <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = list(tokenizer("Fine.", add_special_tokens=False)["input_ids"]) + [end]
    server = ScriptedRequestServer(lambda request: ids, eos_id=end)
    endpoint = ChatEndpoint(EndpointSettings(max_call_tokens=16), tokenizer, server)
    endpoint.start()
    yield endpoint, server
    endpoint.shutdown()


@pytest.fixture
def served(started):
    """``started`` with the engine's request log emptied."""
    started[1].requests.clear()
    return started


def call(url: str, **kwargs):
    """One chat-completions call through the openai client (default retries: a refusal must not be retried)."""
    async def main():
        async with AsyncOpenAI(base_url=url, api_key="-") as client:
            return await client.chat.completions.create(model="policy", **kwargs)
    return asyncio.run(main())


HELLO = [{"role": "user", "content": "Hello."}]


def refused(url: str, error: type, **kwargs) -> str:
    with pytest.raises(error) as info:
        call(url, **kwargs)
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert "Traceback" not in message and "\n" not in message
    return message


def test_agent_endpoint_refuses_calls_after_close_and_unknown_urls(served):
    endpoint, server = served
    url = endpoint.open_episode("late", seed=1, max_episode_tokens=512)
    call(url, messages=HELLO)
    record = endpoint.close_episode("late")
    message = refused(url, openai.NotFoundError, messages=HELLO)
    assert "'late' has ended" in message and len(server.requests) == 1  # not retried, never sampled
    assert len(record.calls) == 1 and record.refused == [
        "a call after the episode closed (the agent returned, or its time ran out)"]
    bogus = url.replace("/episodes/", "/episodes/9").rstrip("/")
    assert "no episode is served at this URL" in refused(bogus, openai.NotFoundError, messages=HELLO)
    with pytest.raises(KeyError, match="'late' is not open"):
        endpoint.close_episode("late")
    with pytest.raises(ValueError, match="already open"):
        endpoint.open_episode("twice", seed=1, max_episode_tokens=64)
        endpoint.open_episode("twice", seed=1, max_episode_tokens=64)


def test_agent_endpoint_refuses_a_prompt_over_the_episode_budget(served):
    endpoint, server = served
    url = endpoint.open_episode("tight", seed=1, max_episode_tokens=40)
    long = [{"role": "user", "content": "word " * 60}]
    message = refused(url, openai.BadRequestError, messages=long)
    assert "over the episode's token budget" in message and "may hold 40" in message and not server.requests
    first = call(url, messages=HELLO, max_tokens=1000)  # a short prompt: capped at what is left, not refused
    assert server.requests[0].max_tokens == 40 - first.usage.prompt_tokens
    record = endpoint.close_episode("tight")
    assert len(record.refused) == 1 and record.refused[0].startswith("call 1: over the episode's token budget")
    assert len(record.calls) == 1


def test_agent_endpoint_refuses_rewritten_history_when_the_spec_says_so(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    server = ScriptedRequestServer(lambda request: [end], eos_id=end)
    endpoint = ChatEndpoint(EndpointSettings(rewritten_history="refuse"), tokenizer, server)
    endpoint.start()
    try:
        url = endpoint.open_episode("strict", seed=1, max_episode_tokens=512)
        first = call(url, messages=HELLO)
        extended = [*HELLO, first.choices[0].message, {"role": "user", "content": "More."}]
        assert call(url, messages=extended).model_extra["extends"]
        dropped = [*HELLO, {"role": "user", "content": "More."}]  # the assistant turn dropped
        assert "do not extend the episode's history" in refused(url, openai.BadRequestError, messages=dropped)
        record = endpoint.close_episode("strict")
    finally:
        endpoint.shutdown()
    assert [c.extends for c in record.calls] == [False, True] and len(record.refused) == 1
    assert "rollout.endpoint.rewritten_history is 'refuse'" in record.refused[0]


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"messages": HELLO, "stream": True}, "stream: true is not served"),
    ({"messages": HELLO, "n": 2}, "samples one choice per call"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text content is served, got a 'image_url' part"),
    ({"messages": [{"role": "narrator", "content": "Hi."}]}, "unknown role 'narrator'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}]}, "tool_calls[0]: expected"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": HELLO, "stop": [f"<{i}>" for i in range(65)]}, "stop: 65 string(s), the longest 4 characters; "
     "expected at most 64 of at most 256 characters each (rollout.stop's bounds)"),
    ({"messages": HELLO, "stop": "x" * 257}, "stop: 1 string(s), the longest 257 characters"),
])
def test_agent_endpoint_refuses_malformed_calls_in_one_line(served, kwargs, expected):
    endpoint, server = served
    url = endpoint.open_episode("bad", seed=1, max_episode_tokens=512)
    message = refused(url, openai.BadRequestError, **kwargs)
    record = endpoint.close_episode("bad")
    assert expected in message and record.refused == [f"call 1: {message}"] and not record.calls
    assert not server.requests


def test_agent_endpoint_refuses_a_body_that_is_not_json_and_serves_models(served):
    endpoint, _ = served
    url = endpoint.open_episode("raw", seed=1, max_episode_tokens=512)
    answer = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.headers["x-should-retry"] == "false"
    assert answer.json()["error"]["message"] == "the request body is not JSON (JSONDecodeError)"
    async def models():
        async with AsyncOpenAI(base_url=url, api_key="-") as client:
            return [m.id async for m in client.models.list()]

    assert asyncio.run(models()) == ["policy"]
    assert len(endpoint.close_episode("raw").refused) == 1


def test_agent_endpoint_refuses_a_lone_surrogate_as_the_agents_bad_text_not_an_internal_error(served):
    """JSON may escape half of a surrogate pair (``json.dumps`` writes ``"\\udc80"`` for text read with
    ``errors="surrogateescape"``, e.g. a tool's undecodable output); no tokenizer reads it: a 400 naming where it is,
    not a 500 "internal error" of ours, and the endpoint serves on."""
    endpoint, _ = served
    url = endpoint.open_episode("surrogate", seed=1, max_episode_tokens=512)
    tool_output = b"ok \x80 done".decode("utf-8", errors="surrogateescape")
    body = json.dumps({"messages": [*HELLO, {"role": "user", "content": tool_output}]})  # ensure_ascii: \udc80
    answer = httpx.post(f"{url}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("messages[1].content: not valid Unicode text (a lone surrogate") and "\n" not in message
    assert call(url, messages=HELLO).choices[0].message.content == "Fine."
    record = endpoint.close_episode("surrogate")
    assert len(record.refused) == 1 and len(record.calls) == 1


def test_agent_endpoint_refuses_what_the_chat_template_fails_on(tokenizer):
    strict = ("{%- for m in messages -%}{%- if m['role'] == 'tool' -%}{{ raise_exception('no tool role here') }}"
              "{%- endif -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
              "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endpoint = ChatEndpoint(EndpointSettings(), tokenizer, ScriptedRequestServer(lambda r: [end]), strict)
    endpoint.start()
    try:
        url = endpoint.open_episode("tmpl", seed=1, max_episode_tokens=512)
        first = call(url, messages=HELLO)
        tool = [*HELLO, first.choices[0].message, {"role": "tool", "content": "x"}]
        message = refused(url, openai.BadRequestError, messages=tool)
        assert "the chat template failed on the messages" in message and "no tool role here" in message
        assert len(endpoint.close_episode("tmpl").refused) == 1
    finally:
        endpoint.shutdown()


def test_agent_endpoint_engine_failures_end_the_episode_not_the_endpoint(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = iter([[end], RuntimeError("engine-0 died\nfor good"), "abort", [end]])
    server = ScriptedRequestServer(lambda request: next(script), eos_id=end)
    endpoint = ChatEndpoint(EndpointSettings(), tokenizer, server)
    endpoint.start()
    try:
        lost = endpoint.open_episode("lost", seed=1, max_episode_tokens=512)
        first = call(lost, messages=HELLO)
        more = [*HELLO, first.choices[0].message, {"role": "user", "content": "More."}]
        message = refused(lost, openai.InternalServerError, messages=more)
        assert "the engine failed (RuntimeError: engine-0 died for good)" in message
        assert "cannot continue" in refused(lost, openai.BadRequestError, messages=more)
        aborted = endpoint.open_episode("aborted", seed=2, max_episode_tokens=512)
        assert "gave up on the request" in refused(aborted, openai.InternalServerError, messages=HELLO)
        fine = endpoint.open_episode("fine", seed=3, max_episode_tokens=512)
        assert call(fine, messages=HELLO).choices[0].finish_reason == "stop"  # the endpoint still serves
        records = [endpoint.close_episode(k) for k in ("lost", "aborted", "fine")]
    finally:
        endpoint.shutdown()
    assert len(server.requests) == 4  # one each: nothing retried
    assert [len(r.refused) for r in records] == [2, 1, 0]
    assert [c.finish_reason for c in records[1].calls] == ["abort"] and len(records[0].calls) == 1


def test_agent_endpoint_internal_error_is_one_line(served, monkeypatch):
    endpoint, _ = served

    def broken(text, tools):
        raise TypeError("a bug\nover two lines")

    monkeypatch.setattr(endpoint.service.parser, "parse", broken)
    url = endpoint.open_episode("bug", seed=1, max_episode_tokens=512)
    tools = [{"type": "function", "function": {"name": "f"}}]
    message = refused(url, openai.InternalServerError, messages=HELLO, tools=tools)
    assert message == "internal error in the agent endpoint: TypeError: a bug over two lines"
    endpoint.close_episode("bug")


def test_agent_endpoint_answers_without_a_delayed_ack_stall(served):
    """Uvicorn writes a response's headers and body apart: without TCP_NODELAY on the accepted connections each
    call waited for the client's delayed ACK (~40 ms on Linux; measured 44 ms per call before the fix)."""
    endpoint, _ = served
    with httpx.Client() as client:
        seconds = []
        for _ in range(9):
            started = time.perf_counter()
            assert client.get(f"{endpoint.url}/health").status_code == 200
            seconds.append(time.perf_counter() - started)
    assert sorted(seconds)[4] < 0.03, seconds


def test_agent_endpoint_stop_bounds_are_rollout_stops():
    from cluster.endpoint import chat_request
    from cluster.spec import rollout

    assert (chat_request.MAX_STOP_STRINGS, chat_request.MAX_STOP_CHARS) == (rollout.MAX_STOP_STRINGS,
                                                                             rollout.MAX_STOP_CHARS)
