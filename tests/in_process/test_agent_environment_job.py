"""An environment on the agent pool (``rollout.multi_turn.runner: agent_pool``) through the real loop (``GRPOJob`` on
the in-process runtime): its episodes run on local agent workers and call a stand-in endpoint
(``tests/agent_endpoint.py``) sampling from the job's fleet; reward functions score the episode's text, turn rewards
are ``reward/environment``, observation tokens are masked and, on-policy, the trainer's logprobs are the fleet's."""

from __future__ import annotations

import pytest

from cluster.in_process import local_agent_pool
from tests.agent_endpoint import StandInEndpoint, fleet_sampler
from tests.in_process.test_agent_environment_kind import SCRIPTED, TURN
from tests.local_runtime import local_spec


def test_agent_environment_kind_trains_in_the_loop(tiny_model_dir, tmp_path):
    """``multi_turn.runner: agent_pool`` through the real loop: reward functions on the episode's text plus the turn
    rewards (``reward/environment``), observation tokens masked, on-policy logprobs equal to the fleet's."""
    import json

    from transformers import AutoTokenizer

    from cluster.driver import GRPOJob
    from cluster.in_process import LocalFleet, LocalTrainer
    from tests.job_runs import stopped_after

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(4)))
    spec = local_spec(tiny_model_dir, str(tmp_path), total_steps=1, data={"train_path": str(data)},
                      rollout={"max_response_tokens": TURN, "group_size": 2,
                               "multi_turn": {**SCRIPTED, "runner": "agent_pool"}},
                      algorithm={"kl_coef": 0.04, "rewards": {"format": 1.0}}, metrics={"port": None},
                      checkpoint={"every_steps": 0, "save_final": False})
    fleet = LocalFleet(spec)
    endpoint = StandInEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir), fleet_sampler(fleet),
                               max_call_tokens=TURN)
    job = GRPOJob(spec, fleet=fleet, trainer=LocalTrainer(spec), agent_pool=local_agent_pool(spec),
                  agent_endpoint=endpoint, progress=False)
    with stopped_after(job):
        (metrics,) = job.run()
    assert metrics["policy_version"] == 1 and metrics["sync/verified"] is True
    assert metrics["episode/turns_mean"] == 2.0 and metrics["episode/calls_mean"] == 2.0
    assert metrics["episode/observation_tokens_mean"] > 0 and metrics["episode/infra_failed"] == 0
    assert metrics["reward/environment"] == pytest.approx(0.75) and "reward/format" in metrics
    assert metrics["rollout/logprob_diff"] < 2e-5 and metrics["response_length/mean"] <= 2 * TURN
