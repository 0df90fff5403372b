"""Ecosystem environments train through the real loop (``GRPOJob`` on the in-process runtime): a TextArena game
(``rollout.agent: "textarena:GuessTheNumber-v0"``) and a Gymnasium text environment registered by a user's file
(``gymnasium:arithmetic_env.py:ArithmeticDrill-v0``, ``examples/gymnasium``), each run unchanged on the local agent
pool, every move a call to a stand-in endpoint (``tests/agent_endpoint.py``) sampling from the job's fleet. Two steps
each on the tiny random Llama: the weights update and sync; the trainer's sequences are the endpoint's recorded
token ids, one sequence per episode (every call extends the previous one); on-policy, its logprobs are the fleet's;
the rewards are the environment's own (the recorded replies played again on a fresh environment give the same
mean)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.in_process import LocalFleet, local_agent_pool
from cluster.loop.agent_sequences import agent_sequences
from tests.agent_endpoint import StandInEndpoint, fleet_sampler
from tests.in_process.test_agent_job import RecordingTrainer
from tests.ecosystem_replay import replay_gymnasium, replay_textarena
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec

REPO = Path(__file__).resolve().parents[2]
SEED = 7  # every row plays the same game, so the replayed mean is comparable with the steps' reward/agent


def train(tiny_model_dir, out: Path, agent: str, options: dict) -> dict:
    """Two steps of ``agent`` (B = 2 rows x G = 4 episodes); what the test checks."""
    from transformers import AutoTokenizer

    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"game {i}", "seed": SEED, "answer": ""}) + "\n"
                            for i in range(4)))
    spec = local_spec(tiny_model_dir, str(out), total_steps=2,
                      data={"train_path": str(data), "prompt_field": "prompt", "shuffle": False,
                            "max_prompt_tokens": 64},
                      rollout={"max_response_tokens": 6, "agent": agent, "agent_options": options,
                               "agent_pool": {"workers": 1, "episodes_per_worker": 8, "timeout_s": 120,
                                              "max_episode_tokens": 640}},
                      algorithm={"kl_coef": 0.04}, metrics={"port": None},
                      checkpoint={"every_steps": 0, "save_final": False})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    fleet = LocalFleet(spec)
    endpoint = StandInEndpoint(tokenizer, fleet_sampler(fleet), max_call_tokens=6)
    job = GRPOJob(spec, fleet=fleet, trainer=RecordingTrainer(spec), agent_pool=local_agent_pool(spec),
                  agent_endpoint=endpoint, progress=False)
    with stopped_after(job):
        history = job.run()
    records = list(endpoint.closed.values())
    replies = [[tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in r.calls] for r in records]
    return {"history": history, "records": records, "replies": replies, "trained": job.trainer.sequences,
            "first_prompt": tokenizer.decode(records[0].calls[0].prompt_ids), "refused": endpoint.late_calls}


def check_trained(run: dict) -> None:
    step1, step2 = run["history"]
    assert [step1["policy_version"], step2["policy_version"]] == [1, 2]
    for m in (step1, step2):
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["reward/infra_failed"] == 0 and m["episode/infra_failed"] == 0 and m["agent_pool/episodes"] >= 8
        assert m["episode/calls_mean"] >= 1 and m["episode/rewritten_fraction"] == 0  # every call extends
        assert m["episode/observation_tokens_mean"] > 0 or m["episode/calls_mean"] == 1
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]  # on-policy: trainer == fleet
    recorded = {tuple(s.prompt_ids + s.response_ids) for r in run["records"] for s in agent_sequences(r)}
    assert len(run["records"]) == 16 and len(recorded) <= 16  # one sequence per episode
    assert set(run["trained"]) <= recorded and len(run["trained"]) == 16 and not run["refused"]


def test_agent_textarena_game_trains_in_the_loop(tiny_model_dir, tmp_path):
    pytest.importorskip("textarena", reason="the textarena extra is not installed: pip install "
                                                 "'grpo-cluster[textarena]'")
    run = train(tiny_model_dir, tmp_path, "textarena:GuessTheNumber-v0", {"max_tokens": 6, "max_turns": 3})
    check_trained(run)
    assert "You are playing Guess The Number" in run["first_prompt"]  # the game's own text reached the model
    # the same moves on a fresh game of the same seed
    played = [replay_textarena("GuessTheNumber-v0", SEED, replies)[0] for replies in run["replies"]]
    means = [m["reward/agent"] for m in run["history"]]
    assert statistics.fmean(played) == pytest.approx(statistics.fmean(means))
    assert all("reward/invalid_move" in m for m in run["history"])


def test_agent_gymnasium_text_environment_trains_in_the_loop(tiny_model_dir, tmp_path):
    pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed: pip install "
                                                  "'grpo-cluster[gymnasium]'")
    shutil.copy(REPO / "examples" / "gymnasium" / "arithmetic_env.py", tmp_path / "arithmetic_env.py")
    run = train(tiny_model_dir, tmp_path, f"gymnasium:{tmp_path / 'arithmetic_env.py'}:ArithmeticDrill-v0",
                {"max_tokens": 6})
    check_trained(run)
    assert "Answer with the number." in run["first_prompt"]
    played = [replay_gymnasium("ArithmeticDrill-v0", SEED, replies) for replies in run["replies"]]
    assert all(len(r) == 3 for r in run["replies"])  # one call per problem, never cut
    means = [m["reward/agent"] for m in run["history"]]
    assert statistics.fmean(played) == pytest.approx(statistics.fmean(means))
