"""The agent endpoint's own overhead per call against the engine's time (issue 36: "the endpoint's own overhead
≤ 10 % of engine time per call").

C agents written with the ``openai`` client run at once, each an episode of K calls over loopback HTTP
(``cluster.endpoint.server.ChatEndpoint``): every call sends the whole conversation so far with a tool list, gets a
completion, and appends it and a tool output of about 60 tokens (so prompts grow from ~60 to ~60 + K·(T + 80)
tokens, each call extending the previous one token for token). Per call:

- ``endpoint_s``: the endpoint's own work, measured by the endpoint (``CallRecord.endpoint_s``: reading the call,
  its prompt ids, the TokenRequest, decoding and parsing the completion, the response object);
- ``round trip``: the client's wall seconds for the call minus the seconds the endpoint waited for the engine:
  the endpoint's work plus HTTP, JSON and the ``openai`` client's own parsing, on the same two cores;
- ``engine_s``: the engine's seconds for the call (``TokenResult.engine_s``).

Engines (``--engine``):

- ``model`` (default): SmolLM2-135M-Instruct (float32) sampling in this process with the in-process fleet's sampler
  (``tests/request_server_stub.TinyModelRequestServer``: queued calls decoded together), T tokens per call at most;
- ``timed``: a stand-in that answers every call after ``--engine-ms`` with T scripted tokens (a Hermes tool call),
  to read the endpoint's overhead in milliseconds against an engine as fast as a GPU's (no model on the cores).

Usage (from the repo root; heavy: take the lock)::

    flock /work/heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_agent_endpoint
    flock /work/heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_agent_endpoint --engine timed \\
        --engine-ms 100 --agents 16

Prints a table and, last, one JSON line (``bench/_common.print_json``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench._common import DEFAULT_MODEL, load_note, print_json, print_table, resolve_model

TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run a Python program.",
                                           "parameters": {"type": "object",
                                                          "properties": {"code": {"type": "string"}}}}}]
TOOL_OUTPUT = ("Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\n"
               "    assert add(2, 3) == 5\nAssertionError: expected 5, got 6 <|im_end|>")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def episode(url: str, row: int, calls: int, walls: list[float]) -> None:
    """One agent: ``calls`` calls, each answered by a tool output; client wall seconds per call into ``walls``."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as client:
        messages = [{"role": "system", "content": "Write the function, run the tests with the python tool."},
                    {"role": "user", "content": f"Write add(a, b) that returns a + b. Case {row}."}]
        for k in range(calls):
            started = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            walls.append(time.perf_counter() - started)
            messages += [reply.choices[0].message,
                         {"role": "tool", "tool_call_id": f"call_{k + 1}_0", "content": TOOL_OUTPUT}]


def make_server(args, tokenizer):
    """The engine stand-in and a function that closes it."""
    from tests.request_server_stub import ScriptedRequestServer, TinyModelRequestServer

    if args.engine == "timed":
        call = '<tool_call>{"name": "python", "arguments": {"code": "def add(a, b):\\n    return a + b"}}</tool_call>'
        ids = list(tokenizer("I will test it. " + call * 4, add_special_tokens=False)["input_ids"])[:args.tokens]
        return ScriptedRequestServer(lambda request: ids, delay_s=args.engine_ms / 1000), lambda: None
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.eos import eos_token_ids

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    eos = eos_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id)
    server = TinyModelRequestServer(model, tokenizer, eos)
    return server, server.close


def run(args) -> dict:
    from transformers import AutoTokenizer

    from cluster.endpoint import ChatEndpoint, EndpointSettings

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    server, close = make_server(args, tokenizer)
    endpoint = ChatEndpoint(EndpointSettings(max_call_tokens=args.tokens, model_name="policy"), tokenizer, server)
    endpoint.start()
    walls: list[list[float]] = [[] for _ in range(args.agents)]
    try:
        urls = [endpoint.open_episode(f"e{i}", seed=i, max_episode_tokens=8192) for i in range(args.agents)]

        async def main():
            await asyncio.gather(*(episode(url, i, args.calls, walls[i]) for i, url in enumerate(urls)))

        started = time.perf_counter()
        asyncio.run(main())
        wall = time.perf_counter() - started
        records = [endpoint.close_episode(f"e{i}") for i in range(args.agents)]
    finally:
        endpoint.shutdown()
        close()
    calls = [c for r in records for c in r.calls]
    client_s = [w for episode_walls in walls for w in episode_walls]  # in the records' order
    own = [c.endpoint_s for c in calls]
    engine = [c.engine_s for c in calls]
    trip = [w - (c.seconds - c.endpoint_s) for w, c in zip(client_s, calls)]
    ratios = [o / e for o, e in zip(own, engine)]
    trip_ratios = [t / e for t, e in zip(trip, engine)]
    return {"engine": args.engine, "agents": args.agents, "calls": len(calls), "tokens_per_call": args.tokens,
            "extending": sum(c.extends for c in calls), "wall_s": round(wall, 2),
            "prompt_tokens_max": max(len(c.prompt_ids) for c in calls),
            "endpoint_ms_median": 1000 * statistics.median(own), "endpoint_ms_p90": 1000 * quantile(own, 0.9),
            "endpoint_ms_max": 1000 * max(own),
            "round_trip_ms_median": 1000 * statistics.median(trip), "round_trip_ms_p90": 1000 * quantile(trip, 0.9),
            "engine_ms_median": 1000 * statistics.median(engine),
            "overhead_median": statistics.median(ratios), "overhead_p90": quantile(ratios, 0.9),
            "overhead_max": max(ratios), "round_trip_overhead_median": statistics.median(trip_ratios),
            "round_trip_overhead_p90": quantile(trip_ratios, 0.9), **load_note()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("model", "timed"), default="model")
    parser.add_argument("--agents", type=int, default=8, help="episodes at once (C)")
    parser.add_argument("--calls", type=int, default=4, help="calls per episode (K)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per call at most (T)")
    parser.add_argument("--engine-ms", type=float, default=100.0, help="timed engine: seconds per call, in ms")
    parser.add_argument("--threads", type=int, default=2, help="model engine: torch threads")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    args.model_dir = resolve_model(args.model)
    out = run(args)
    rows = [[out["engine"], out["calls"], out["engine_ms_median"], out["endpoint_ms_median"], out["endpoint_ms_p90"],
             100 * out["overhead_median"], 100 * out["overhead_p90"], out["round_trip_ms_median"],
             100 * out["round_trip_overhead_median"]]]
    print_table(["engine", "calls", "engine ms", "endpoint ms", "p90 ms", "own %", "p90 %", "round trip ms",
                 "round trip %"], rows, title=f"agent endpoint, {out['agents']} agents x {args.calls} calls")
    print_json("agent_endpoint", out)


if __name__ == "__main__":
    main()
