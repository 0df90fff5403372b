"""The endpoint's answers, built with the ``openai`` package's own pydantic types: a ``ChatCompletion`` per call, a
model list, an OpenAI error body.

Besides OpenAI's fields a completion carries (pydantic extras, ignored by clients that do not read them; the names of
vLLM's ``return_token_ids`` where vLLM has one):

- ``choices[0].token_ids``: the sampled token ids (stop text / EOS included as sampled);
  ``choices[0].token_logprobs``: their behaviour logprobs (natural log); ``choices[0].token_versions``: the policy
  version of each;
- ``prompt_token_ids`` (only when the call asked ``return_token_ids: true``): the prompt ids the engine continued;
- ``extends``: whether the call's prompt extended the episode's previous call (False: first call or rewritten
  history); ``tokens_left``: what is left of the episode's token budget after this call;
- ``sampling``: what the call was sampled with (temperature, top_p, top_k, min_p, max_tokens, seed, stop) and
  ``notes``: one line per asked value that was not honoured (``cluster.endpoint.chat_request``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat import ChatCompletionMessageFunctionToolCall as FunctionToolCall
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.completion_usage import CompletionUsage

from rollout_workers.tool_parsers import ParsedTurn

__all__ = ["assistant_message", "completion", "error_body", "model_list", "tool_call_id"]


def tool_call_id(call: int, index: int) -> str:
    """The id of the ``index``-th tool call (0-based) of call ``call`` (1-based) of an episode: unique within it."""
    return f"call_{call}_{index}"


def assistant_message(turn: ParsedTurn, call: int) -> ChatCompletionMessage:
    """The assistant message a call returns: the parsed content and tool calls (ids from :func:`tool_call_id`)."""
    calls = [FunctionToolCall(id=tool_call_id(call, i), type="function",
                              function=Function(name=c.name, arguments=c.arguments)) for i, c in enumerate(turn.calls)]
    return ChatCompletionMessage(role="assistant", content=turn.content, tool_calls=calls or None)


def completion(*, completion_id: str, model: str, message: ChatCompletionMessage, finish_reason: str,
               prompt_ids: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float],
               versions: Sequence[int], token_texts: Sequence[str] | None, extends: bool, tokens_left: int,
               sampling: dict, return_prompt_ids: bool) -> ChatCompletion:
    """One call's ``ChatCompletion`` (module docstring). ``token_texts``: each sampled token's text when the call
    asked ``logprobs`` (None: no OpenAI ``logprobs``)."""
    choice_logprobs = None
    if token_texts is not None:
        choice_logprobs = ChoiceLogprobs(content=[
            ChatCompletionTokenLogprob(token=text, bytes=list(text.encode("utf-8")), logprob=float(lp),
                                       top_logprobs=[]) for text, lp in zip(token_texts, logprobs)])
    choice = Choice(index=0, finish_reason=finish_reason, message=message, logprobs=choice_logprobs,
                    token_ids=list(token_ids), token_logprobs=[float(x) for x in logprobs],
                    token_versions=list(versions))
    usage = CompletionUsage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids),
                            total_tokens=len(prompt_ids) + len(token_ids))
    extra = {"prompt_token_ids": list(prompt_ids)} if return_prompt_ids else {}
    return ChatCompletion(id=completion_id, object="chat.completion", created=int(time.time()), model=model,
                          choices=[choice], usage=usage, extends=extends, tokens_left=tokens_left, sampling=sampling,
                          **extra)


def model_list(model: str) -> dict:
    """``GET /models``: the one model served."""
    return {"object": "list", "data": [Model(id=model, object="model", created=0, owned_by="grpo-cluster")
                                       .model_dump()]}


def error_body(reason: str, code: str, status: int) -> dict:
    """An OpenAI error body (what the ``openai`` client reads into its exception's message)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": reason, "type": kind, "param": None, "code": code}}
