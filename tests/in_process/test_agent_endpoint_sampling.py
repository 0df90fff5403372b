"""The agent endpoint over a real sampler: agents written with the ``openai`` client run concurrently against the
tiny random Llama (the in-process fleet itself as the ``RequestServer``: its hf engine's request-level serving), and
the train rank, given the
sequences built from the endpoint's records (``cluster.loop.agent_sequences``, packed with their loss masks), scores
exactly the sampled tokens: its logprobs of every sampled token equal the behaviour logprobs the engine recorded, and
every inserted token (tool outputs that spell ``<|im_end|>``, the template's delimiters) is out of the loss. Under
SmolLM2's own template and a Qwen3-like thinking template (``data.chat_template``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from openai import AsyncOpenAI

from cluster.endpoint import ChatEndpoint
from cluster.loop.agent_sequences import agent_sequences
from tests.chat_templates import QWEN3_LIKE
from tests.local_runtime import local_spec, running
from train_workers.packing import pack_microbatch

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
ROWS = ["What is 2 + 3?", "Name a colour."]


class Recorded:
    """The fleet's ``submit`` with every request kept (``contract.requests.RequestServer``)."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return self.fleet.submit(request)


async def agent(client: AsyncOpenAI, row: str) -> int:
    """Three calls, each answered by a tool output that spells the template's special tokens."""
    messages = [{"role": "system", "content": "Use python."}, {"role": "user", "content": row}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        messages += [reply.choices[0].message,
                     {"role": "tool", "tool_call_id": f"t{turn}", "content": f"out {turn}<|im_end|>\n<|im_start|>"}]
    return len(messages)


@pytest.mark.parametrize("template", [None, QWEN3_LIKE], ids=["smollm2", "qwen3_like"])
def test_agent_endpoint_trainer_scores_exactly_the_sampled_tokens(tiny_model_dir, tmp_path, template):
    rollout = {"temperature": 0.9, "top_k": 50, "top_p": 0.8, "max_response_tokens": 6}
    data = {"chat_template": template} if template else {}
    spec = local_spec(tiny_model_dir, str(tmp_path), rollout=rollout, data=data)
    with running(spec, tiny_model_dir) as (trainer, fleet, _):
        server, tokenizer = Recorded(fleet), fleet.engine.tokenizer
        endpoint = ChatEndpoint.from_spec(spec, tokenizer, server)
        endpoint.start()
        try:
            urls = [endpoint.open_episode(f"e{i}", seed=100 + i, max_episode_tokens=2048) for i in range(len(ROWS))]

            async def main():
                clients = [AsyncOpenAI(base_url=url, api_key="-", max_retries=0) for url in urls]
                return await asyncio.gather(*(agent(c, row) for c, row in zip(clients, ROWS)))

            assert asyncio.run(main()) == [8, 8]
            records = [endpoint.close_episode(f"e{i}") for i in range(len(ROWS))]
        finally:
            endpoint.shutdown()
        sequences = [seq for record in records for seq in agent_sequences(record)]
        assert len(sequences) == 2 and all(seq.calls == 3 for seq in sequences)
        by_prompt = {tuple(r.prompt_ids): r for r in server.requests}
        for record in records:
            for call in record.calls:
                assert list(by_prompt[tuple(call.prompt_ids)].prompt_ids) == call.prompt_ids
        mb = pack_microbatch([s.prompt_ids for s in sequences], [s.response_ids for s in sequences], [1.0, -1.0],
                             [torch.tensor(s.logprobs) for s in sequences], [0, 1],
                             loss_masks=[s.loss_mask for s in sequences])
        scored = trainer.reference_logprobs(mb)  # the initial weights: the ones that sampled
    packed = [t for s in sequences for t in s.prompt_ids + s.response_ids]
    assert mb.input_ids[0].tolist() == packed  # the trainer's token ids: the endpoint's, as recorded
    last = records[0].calls[-1]
    assert sequences[0].prompt_ids + sequences[0].response_ids == last.prompt_ids + last.completion_ids
    mask = mb.response_mask.bool()
    assert int(mask.sum()) == sum(s.sampled_tokens for s in sequences) == 2 * 3 * 6
    gap = float((scored[mask] - mb.behaviour_logprobs[mask]).abs().max())
    assert gap < 5e-5, gap
    text = tokenizer.decode(sequences[0].prompt_ids + sequences[0].response_ids)
    assert text.count("out 1<|im_end|>\n<|im_start|>") == 1  # the tool output, as text, once
