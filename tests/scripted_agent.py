"""One agent episode through the real agent endpoint (``cluster.endpoint.ChatEndpoint``: the job's chat template,
tool-call parser, token budget) over a scripted engine (``tests/request_server_stub.py``), for tests of agents
written with the ``openai`` client (examples/code_agent, examples/tool_calc_agent).

    out, record, calls = scripted_episode(spec, tokenizer, run, ["reply 1", "reply 2"], row)

``out`` is what the agent returned, ``record`` the endpoint's :class:`contract.agents.EpisodeRecord` (what the trainer
learns from) and ``calls`` the messages of every call as the endpoint read them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence

from cluster.endpoint import ChatEndpoint
from tests.request_server_stub import ScriptedRequestServer

__all__ = ["scripted_episode"]


def scripted_episode(spec, tokenizer, run: Callable, replies: Sequence[str], row: dict, budget: int | None = None,
                     **options):
    """Run ``run(client, row, **options)`` (``rollout.agent_options`` unless given) as one episode whose calls are
    answered with ``replies`` in turn, each ended by ``<|im_end|>`` (module docstring). ``budget``: the episode's
    token budget (default ``rollout.agent_pool.max_episode_tokens``)."""
    from openai import AsyncOpenAI

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end] for text in replies]
    server = ScriptedRequestServer(script, eos_id=end)
    endpoint = ChatEndpoint.from_spec(spec, tokenizer, server)
    seen: list[list[dict]] = []
    complete = endpoint.service.complete

    async def recording(token, body):
        seen.append(json.loads(body)["messages"] if isinstance(body, (bytes, str)) else body["messages"])
        return await complete(token, body)

    endpoint.service.complete = recording
    endpoint.start()
    try:
        budget = budget or spec.rollout.agent_pool.max_episode_tokens
        url = endpoint.open_episode("e0", seed=3, max_episode_tokens=budget, group_id=0, sample=0)

        async def main():
            async with AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as client:
                return await run(client, dict(row), **{**spec.rollout.agent_options, **options})

        out = asyncio.run(main())
        return out, endpoint.close_episode("e0"), seen
    finally:
        endpoint.shutdown()
