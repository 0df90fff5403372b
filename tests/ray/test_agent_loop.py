"""An agent spec (``rollout.agent``) trains under Ray with its episodes on the agent pool's worker actors
(``cluster.ray_shell.agent_pool``: async actors running many episodes each).

``test_agent_trains_a_step_on_ray_agent_actors``: the loop (``GRPOJob``) with the in-process fleet and trainer, the
agent pool of Ray actors and a stand-in endpoint (``tests/agent_endpoint.py``) sampling from the fleet: one step,
its rewards from the agents, an actor killed mid-episode losing only its own episodes (infrastructure failures,
counted) and replaced. No vLLM engine starts (tests/conftest.py ``NO_ENGINE``).

``test_agent_spec_trains_with_build_job``: the same agent through ``build_job`` (what ``run`` and a submitted job
build: vLLM engines, FSDP2 ranks, the agent pool's actors) and the job's own chat-completions endpoint
(``cluster.endpoint.job.job_endpoint``) sampling through the Ray fleet's request-level ``EngineFleet.submit`` (each
call one ``serve`` call on an engine actor): the step's figures count the served requests.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from cluster.driver import GRPOJob
from cluster.in_process import LocalFleet, LocalTrainer
from tests.agent_endpoint import StandInEndpoint, fleet_sampler
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec

AGENT = '''\
import asyncio


async def run(client, row, pause_s=0.0):
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    if row.get("slow"):
        await asyncio.sleep(pause_s)
    text = reply.choices[0].message.content
    return {"parity": float(len(text) % 2 == 0), "bonus": 0.5}
'''


def _rows(path: Path) -> str:
    path.write_text("".join(json.dumps({"question": f"Say {i}.", "answer": str(i), "slow": i == 1}) + "\n"
                            for i in range(4)))
    return str(path)


def test_agent_trains_a_step_on_ray_agent_actors(local_ray, tiny_model_dir, tmp_path):
    import ray

    from cluster.ray_shell.agent_pool import ray_agent_pool

    (tmp_path / "agent.py").write_text(AGENT)
    spec = local_spec(tiny_model_dir, str(tmp_path), total_steps=1,
                      data={"train_path": _rows(tmp_path / "train.jsonl"), "shuffle": False},
                      rollout={"max_response_tokens": 6, "agent": f"{tmp_path / 'agent.py'}:run",
                               "agent_options": {"pause_s": 60.0},
                               "agent_pool": {"workers": 2, "episodes_per_worker": 4, "timeout_s": 120}},
                      algorithm={"kl_coef": 0.0}, metrics={"port": None},
                      checkpoint={"every_steps": 0, "save_final": False})
    fleet = LocalFleet(spec)
    from transformers import AutoTokenizer

    endpoint = StandInEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir), fleet_sampler(fleet), max_call_tokens=6)
    pool = ray_agent_pool(spec)
    assert pool.describe() == "2 agent worker(s) (Ray actors, 4 episodes each at once, 120 s per episode)"
    job = GRPOJob(spec, fleet=fleet, trainer=LocalTrainer(spec), agent_pool=pool, agent_endpoint=endpoint,
                  progress=False)

    def kill_the_slow_episodes_actor():  # row 1's episodes sleep 60 s after their call: kill their actor
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            busy = [s for s in pool._slots if s.worker is not None
                    and any(r.ticket.row.get("slow") for r in s.running.values())]
            if busy and len(endpoint.closed) >= 4:  # row 0's episodes are done
                ray.kill(busy[0].worker.actor, no_restart=True)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_slow_episodes_actor, daemon=True)
    killer.start()
    with stopped_after(job):
        (metrics,) = job.run()
    killer.join()
    assert metrics["policy_version"] == 1 and metrics["sync/verified"] is True
    assert metrics["reward/bonus"] == 0.5 and metrics["episode/calls_mean"] >= 0.5
    lost = metrics["agent_pool/lost_episodes"]
    assert 1 <= lost <= 4 and metrics["reward/infra_failed"] == lost  # only the killed actor's episodes
    assert metrics["agent_pool/hung_workers"] == 0 and metrics["agent_pool/episodes"] == 8 - lost


def test_agent_spec_trains_with_build_job(local_ray, tiny_model_dir, tmp_path):
    from cluster.endpoint.job import JobEndpoint
    from cluster.ray_shell.fleet import EngineFleet
    from cluster.ray_shell.runtime import build_job

    (tmp_path / "agent.py").write_text(AGENT)
    spec = local_spec(tiny_model_dir, str(tmp_path), total_steps=1,
                      data={"train_path": _rows(tmp_path / "train.jsonl")},
                      rollout={"max_response_tokens": 6, "agent": f"{tmp_path / 'agent.py'}:run",
                               "agent_pool": {"workers": 1, "timeout_s": 300, "max_episode_tokens": 1024},
                               "kv_cache_gib": 0.5},
                      metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
    job = build_job(spec, progress=False, control=False)
    assert isinstance(job.fleet, EngineFleet) and isinstance(job.agent_endpoint, JobEndpoint)
    assert job.agent_endpoint.server is job.fleet  # the endpoint samples through the Ray fleet's own submit
    with stopped_after(job):
        (metrics,) = job.run()
    assert metrics["policy_version"] == 1 and metrics["sync/verified"] is True
    assert metrics["reward/bonus"] == 0.5 and metrics["episode/calls_mean"] == 1.0
    assert metrics["rollout/request_queue_s"] >= 0.0  # the calls were served requests (EngineFleet.submit)
