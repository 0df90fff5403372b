"""One chat-completions call as the endpoint reads it: the request body, its messages in one normal form, and what
the endpoint refuses.

What a call may ask, and what it gets (the trainer's view decides: ``grpo/logprobs.py`` scores every token at the
spec's ``rollout.temperature`` with its ``top_p``/``top_k``/``min_p``, so a token sampled from another distribution
would be trained with the wrong behaviour logprobs):

- ``temperature``, ``top_p`` (and vLLM's ``top_k``, ``min_p``): honoured when equal to the spec's; any other value is
  *not* honoured: the call is sampled at the spec's values and the response says so (``sampling.notes``). Refusing
  instead would stop most agents written for serving (they set a temperature); clamping to a lower temperature would
  make every such call off-policy for the trainer. An episode the loop opened with a temperature (held-out
  evaluation, 0 greedy) is sampled at that temperature without filters, whatever its calls ask.
- ``max_tokens`` / ``max_completion_tokens``: lowered to ``rollout.endpoint.max_call_tokens`` (default
  ``rollout.max_response_tokens``) and to what is left of the episode's budget; a call with no room left is refused.
- ``stop`` (a string or a list): added to ``rollout.stop``; the stop text stays in the sampled tokens, and is left
  out of the returned content (OpenAI's convention) unless tool calls were read from it. Empty strings are dropped;
  more than :data:`MAX_STOP_STRINGS` strings or one longer than :data:`MAX_STOP_CHARS` characters is refused.
- ``tools`` and ``tool_choice``: tools are passed to the chat template and calls are parsed (``tool_choice`` auto,
  required or a named function: parsed; ``none``: not parsed). Decoding is never constrained to a tool's schema.
- ``seed`` is not honoured: call k of an episode is seeded from the episode's seed and k (reproducible training).
- ``logprobs``: the sampled tokens' logprobs (``top_logprobs`` are not served: empty lists).
- Refused with HTTP 400: ``stream: true``, ``n`` > 1, a message that is not text, an unknown role, malformed JSON,
  a string that is not valid Unicode (a lone surrogate escape, ``\\ud800``: no tokenizer reads it).
- Other OpenAI fields (``response_format``, ``presence_penalty``, ``user``, ...) are ignored.

Messages are compared in one normal form (:func:`normal_message`): role (``developer`` read as ``system``), content
as text (None and [] as "", text parts joined), tool calls as ``{id, type, function: {name, arguments}}`` with the
arguments as a JSON object when they parse (as chat templates expect them), ``tool_call_id`` and ``name`` when given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["ChatRequest", "Refusal", "normal_message", "normal_messages", "parse_request"]

#: A call's ``stop`` at most: strings, and characters per string (the bounds of ``rollout.stop``,
#: ``cluster.spec.rollout.MAX_STOP_STRINGS`` and ``MAX_STOP_CHARS``; every string is searched for at every token).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 256

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Refusal(Exception):
    """A call the endpoint does not serve: ``status`` (HTTP), ``reason`` (one line, recorded in
    ``EpisodeRecord.refused`` and returned as the OpenAI error's message), ``code`` (a short machine-readable tag)."""

    def __init__(self, status: int, reason: str, code: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.code = code


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions body the endpoint reads (others are ignored: module docstring)."""

    model_config = ConfigDict(extra="ignore")
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, lt=1)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    logprobs: bool | None = None
    seed: int | None = None
    return_token_ids: bool | None = None

    @property
    def asked_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) or ``max_tokens``, None when neither."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The call's stop strings (empty ones dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)

    @property
    def parses_tools(self) -> bool:
        """Whether tool calls are read from the completion: tools given and ``tool_choice`` is not ``"none"``."""
        return bool(self.tools) and self.tool_choice != "none"


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg', 'invalid')}"


def _not_unicode(body: dict) -> str | None:
    """Where in the decoded JSON ``body`` a string holds a lone surrogate (JSON's ``\\ud800`` escapes decode to one;
    no UTF-8 text holds it), e.g. ``messages[2].content``; None when every string is text."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return None  # the common case, in C
    except UnicodeEncodeError:
        pass
    todo: list[tuple[str, Any]] = [(str(k), v) for k, v in body.items()]
    while todo:
        where, value = todo.pop(0)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            todo[:0] = [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            todo[:0] = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return "a key of the body"  # only a key held one


def parse_request(body: Any) -> ChatRequest:
    """The body (JSON bytes or text, or the decoded object) as a :class:`ChatRequest`.

    Raises:
        Refusal: 400 for a body that is not a chat-completions request, ``stream: true`` or ``n`` > 1.
    """
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise Refusal(400, f"the request body is not JSON ({type(exc).__name__})", "bad_request") from None
    if not isinstance(body, dict):
        raise Refusal(400, f"expected a JSON object as the request body, got {type(body).__name__}", "bad_request")
    bad = _not_unicode(body)
    if bad is not None:
        raise Refusal(400, f"{bad}: not valid Unicode text (a lone surrogate escape such as \\ud800, which no text "
                      f"encoding holds and the tokenizer cannot read)", "bad_request")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise Refusal(400, f"malformed chat-completions request: {_first_error(exc)}", "bad_request") from None
    if request.stream:
        raise Refusal(400, "stream: true is not served by the agent endpoint (ask without streaming)", "unsupported")
    stops = request.stop_strings
    if len(stops) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
        longest = max(map(len, stops))
        raise Refusal(400, f"stop: {len(stops)} string(s), the longest {longest} characters; expected at most "
                      f"{MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each (rollout.stop's bounds)",
                      "bad_request")
    if request.n is not None and request.n > 1:
        raise Refusal(400, f"n={request.n}: the agent endpoint samples one choice per call (an episode is one "
                      f"trajectory); call again for another", "unsupported")
    return request


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise Refusal(400, f"{where}: only text content is served, got a {kind!r} part", "unsupported")
            parts.append(part["text"])
        return "".join(parts)
    raise Refusal(400, f"{where}: expected text content, got {type(content).__name__}", "bad_request")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as a JSON object when they parse (chat templates expect a mapping), else as given."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise Refusal(400, f"{where}.tool_calls: expected a list, got {type(calls).__name__}", "bad_request")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise Refusal(400, f"{where}.tool_calls[{j}]: expected {{id, type: function, function: {{name, "
                          f"arguments}}}}", "bad_request")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", {}))}})
    return out


def normal_message(message: Any, index: int = 0) -> dict:
    """One message in the endpoint's normal form (module docstring).

    Raises:
        Refusal: 400 naming ``messages[index]``: not an object, an unknown role, content that is not text, malformed
            tool calls.
    """
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise Refusal(400, f"{where}: expected an object with a role, got {type(message).__name__}", "bad_request")
    role = ROLES.get(message.get("role"))
    if role is None:
        raise Refusal(400, f"{where}: unknown role {message.get('role')!r}; expected one of {', '.join(ROLES)}",
                      "bad_request")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise Refusal(400, f"{where}.{key}: expected a string, got {type(value).__name__}", "bad_request")
            out[key] = value
    return out


def normal_messages(messages: list[Any]) -> list[dict]:
    """Every message in normal form (:func:`normal_message`)."""
    return [normal_message(m, i) for i, m in enumerate(messages)]
