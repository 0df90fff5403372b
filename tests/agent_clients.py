"""Scripted stand-ins for an episode's ``openai.AsyncOpenAI`` client, for unit tests of agent kinds: no endpoint, no
model, each call answered with the next scripted reply and its messages kept."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai

from contract.agents import TOKEN_BUDGET_ERROR


def budget_error() -> openai.BadRequestError:
    """The error the real ``openai`` client raises when the endpoint refuses a call for the episode's budget."""
    response = httpx.Response(400, request=httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions"))
    return openai.BadRequestError("no room left", response=response,
                                  body={"message": "no room left", "code": TOKEN_BUDGET_ERROR})


class ScriptedClient:
    """Answers call k with ``replies[k]`` (an exception in the list is raised instead); ``calls`` keeps each call's
    keyword arguments, its messages copied."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs):
        self.calls.append({**kwargs, "messages": [dict(m) for m in kwargs["messages"]]})
        reply = self.replies[len(self.calls) - 1]
        if isinstance(reply, BaseException):
            raise reply
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=reply),
                                                        finish_reason="stop")])

    def extends_every_call(self) -> bool:
        """Each call's messages are the previous call's, its reply, and one new user message."""
        for before, after in zip(self.calls, self.calls[1:]):
            reply = self.replies[self.calls.index(before)]
            expected = [*before["messages"], {"role": "assistant", "content": reply}]
            if after["messages"][:-1] != expected or after["messages"][-1]["role"] != "user":
                return False
        return True
