"""The real loop (``GRPOJob`` on the in-process runtime) with an agent (``rollout.agent``): its episodes run on the
local agent pool and call a stand-in endpoint (``tests/agent_endpoint.py``) that samples each call from the job's own
``LocalFleet``, so the trainer's sequences are the endpoint's recorded token ids and, on-policy, its logprobs of
every sampled token are the fleet's. Two steps on the tiny random Llama: rewards from the agent's return (its
components logged), a rewritten history trained as a second sequence, an agent returning None excluded and counted,
held-out episodes scored by the agent's own reward; then a job whose agent fails every episode of step 2 stops
naming ``algorithm.max_infra_failed_fraction`` with step 1 kept (its metrics and its checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.in_process import LocalFleet, LocalTrainer, local_agent_pool
from cluster.loop.agent_sequences import agent_sequences
from cluster.loop.scoring import InfraFailureError
from tests.agent_endpoint import StandInEndpoint, fleet_sampler
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec

AGENT = '''\
async def run(client, row, turn_tokens=4):
    kind = row.get("kind", "plain")
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=turn_tokens)
    text = first.choices[0].message.content
    if kind == "rewrite":  # a summary replaces the history: a second training sequence
        messages = [{"role": "user", "content": row["prompt"] + " Briefly."}]
    else:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=turn_tokens)
    if kind == "none" or kind == "fails":
        return None
    answer = second.choices[0].message.content
    return {"parity": float(len(answer) % 2 == 0), "bonus": 0.25}
'''
KINDS = ["plain", "rewrite", "plain", "none", "fails", "fails"]


def _rows(path: Path, kinds: list[str]) -> str:
    path.write_text("".join(json.dumps({"question": f"Say {i} words.", "answer": str(i), "kind": kind}) + "\n"
                            for i, kind in enumerate(kinds)))
    return str(path)


def agent_job(tiny_model_dir, out: Path, total_steps: int, **sections):
    (out / "agent.py").write_text(AGENT)
    spec = local_spec(
        tiny_model_dir, str(out), total_steps=total_steps,
        data={"train_path": _rows(out / "train.jsonl", KINDS), "shuffle": False, "max_prompt_tokens": 256},
        rollout={"max_response_tokens": 4, "agent": f"{out / 'agent.py'}:run", "agent_options": {"turn_tokens": 4},
                 "agent_pool": {"workers": 1, "episodes_per_worker": 8, "timeout_s": 120,
                                "max_episode_tokens": 512}},
        algorithm={"kl_coef": 0.04, "max_infra_failed_fraction": 0.5},
        metrics={"port": None}, **sections)
    fleet = LocalFleet(spec)
    from transformers import AutoTokenizer

    endpoint = StandInEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir), fleet_sampler(fleet),
                               max_call_tokens=spec.rollout.max_response_tokens)
    job = GRPOJob(spec, fleet=fleet, trainer=RecordingTrainer(spec), agent_pool=local_agent_pool(spec),
                  agent_endpoint=endpoint, progress=False)
    return job, endpoint


class RecordingTrainer(LocalTrainer):
    """A LocalTrainer that keeps the token ids of every sequence it trains on (prompt + response, read from the
    packed micro-batches: positions restart at 0 for each sequence)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.sequences: list[tuple[int, ...]] = []

    def train_step(self, per_rank, num_tokens, num_sequences):
        for micro_batches in per_rank:
            for mb in micro_batches:
                ids, positions = mb.input_ids[0].tolist(), mb.position_ids[0].tolist()
                starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
                self.sequences += [tuple(ids[a:b]) for a, b in zip(starts, starts[1:])]
        return super().train_step(per_rank, num_tokens, num_sequences)


@pytest.fixture(scope="module")
def agent_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_job")
    held = _rows(out / "held.jsonl", ["plain", "plain"])
    job, endpoint = agent_job(tiny_model_dir, out, 2, eval={"data_path": held, "every_steps": 2, "at_start": False},
                              checkpoint={"every_steps": 0, "save_final": False})
    with stopped_after(job):
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"history": history, "rows": rows, "trained": job.trainer.sequences, "endpoint": endpoint}


def test_agent_job_trains_on_the_agents_rewards(agent_run):
    step1, step2 = agent_run["history"]
    assert [step1["policy_version"], step2["policy_version"]] == [1, 2]
    for m in (step1, step2):
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["episode/calls_mean"] == 2.0 and m["episode/turns_mean"] == 2.0
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]  # on-policy: trainer == fleet
        assert m["reward/bonus"] == pytest.approx(0.25) and "reward/parity" in m and "reward/agent" in m
        assert m["agent_pool/episodes"] >= 8
    assert step1["episode/rewritten_fraction"] == pytest.approx(0.5) and step1["reward/infra_failed"] == 0
    assert step2["episode/rewritten_fraction"] == 0 and step2["reward/infra_failed"] == 4  # "none": excluded
    assert step1["rollout/sequences_trained"] == 12  # 8 episodes, the 4 rewritten ones as 2 sequences each


def test_agent_trainer_sequences_are_the_endpoints_recorded_token_ids(agent_run):
    records = list(agent_run["endpoint"].closed.values())
    recorded = {tuple(s.prompt_ids + s.response_ids) for r in records for s in agent_sequences(r)}
    trained = agent_run["trained"]  # what the train rank packed: prompt + response of every row, in token ids
    assert len(trained) == 12 + 8 and set(trained) <= recorded
    last_calls = {tuple(c.prompt_ids + c.completion_ids) for r in records for c in r.calls}
    assert all(any(seq[:len(call)] == call for call in last_calls) for seq in trained)


def test_agent_held_out_episodes_are_scored_by_the_agents_reward(agent_run):
    evals = [r for r in agent_run["rows"] if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2] and evals[0]["eval/n"] == 2
    assert evals[0]["eval/accuracy"] in (0.0, 0.5, 1.0)  # parity + 0.25 >= 1 only when parity pays
    held = [o for o in agent_run["endpoint"].opened if o["temperature"] is not None]
    assert len(held) == 2 and {o["temperature"] for o in held} == {0.0}  # greedy, eval.temperature


def test_agent_failing_past_the_threshold_stops_the_job_keeping_what_was_trained(tiny_model_dir, tmp_path):
    job, _ = agent_job(tiny_model_dir, tmp_path, 3, checkpoint={"every_steps": 1, "save_final": False})
    job.spec.data  # step 1: rows 0, 1 (plain, rewrite); step 2: rows 2, 3 (plain, none); step 3: both "fails"
    with stopped_after(job), pytest.raises(InfraFailureError, match="algorithm.max_infra_failed_fraction"):
        job.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").is_file()
