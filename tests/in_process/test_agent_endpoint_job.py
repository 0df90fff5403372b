"""The real loop with an agent and the real agent endpoint (``cluster.endpoint.job.job_endpoint``, as the runtimes
build it): two steps of ``GRPOJob`` on the in-process runtime, the agent's episodes on the local agent pool calling
the endpoint, which samples through the job's fleet. The fleet is ``LocalFleet`` serving each request with its own
request-level side (``contract.requests.RequestServer``: its hf engine's batching thread), the requests it served
kept for the checks. Every sequence the train rank packed is a
recorded call's prompt + completion, token for token; on-policy, the trainer's logprobs of the sampled tokens are the
fleet's; a rewritten history is trained as a second sequence; held-out episodes are sampled greedily."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from cluster.driver import GRPOJob
from cluster.endpoint.job import JobEndpoint, job_endpoint
from cluster.in_process import LocalFleet, local_agent_pool
from contract.requests import RequestServer, TokenRequest, TokenResult
from tests.in_process.test_agent_job import AGENT, RecordingTrainer, _rows
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec


class ServingLocalFleet(LocalFleet):
    """``LocalFleet`` whose served requests are kept: ``served``, (request, result) in the order they finished. Its
    ``submit`` is the fleet's own (its hf engine's request-level serving)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.served: list[tuple[TokenRequest, TokenResult]] = []

    def submit(self, request: TokenRequest) -> Future:
        future = super().submit(request)
        future.add_done_callback(lambda done: done.exception() is None and self.served.append((request, done.result())))
        return future


class NoRequests:
    """A fleet without a request-level side (no ``submit``): a third-party fleet written before agents."""

    def __init__(self, spec):
        self.spec = spec


@pytest.fixture(scope="module")
def endpoint_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_endpoint_job")
    (out / "agent.py").write_text(AGENT)
    held = _rows(out / "held.jsonl", ["plain", "plain"])
    spec = local_spec(
        tiny_model_dir, str(out), total_steps=2,
        data={"train_path": _rows(out / "train.jsonl", ["plain", "rewrite", "plain", "plain"]), "shuffle": False,
              "max_prompt_tokens": 256},
        rollout={"max_response_tokens": 4, "agent": f"{out / 'agent.py'}:run", "agent_options": {"turn_tokens": 4},
                 "agent_pool": {"workers": 1, "episodes_per_worker": 8, "timeout_s": 120,
                                "max_episode_tokens": 512}},
        algorithm={"kl_coef": 0.04}, metrics={"port": None},
        eval={"data_path": held, "every_steps": 2, "at_start": False},
        checkpoint={"every_steps": 0, "save_final": False})
    fleet = ServingLocalFleet(spec)
    endpoint = job_endpoint(spec, fleet)
    job = GRPOJob(spec, fleet=fleet, trainer=RecordingTrainer(spec), agent_pool=local_agent_pool(spec),
                  agent_endpoint=endpoint, progress=False)
    with stopped_after(job):
        history = job.run()
    return {"history": history, "trained": job.trainer.sequences, "fleet": fleet, "endpoint": endpoint}


def test_agent_endpoint_is_built_for_agent_jobs_whose_fleet_serves_requests(endpoint_run, tiny_model_dir, tmp_path):
    assert isinstance(endpoint_run["endpoint"], JobEndpoint) and isinstance(endpoint_run["fleet"], RequestServer)
    plain = local_spec(tiny_model_dir, str(tmp_path))
    assert job_endpoint(plain, ServingLocalFleet(plain)) is None  # no agent: no endpoint
    agent_spec = endpoint_run["fleet"].spec
    assert job_endpoint(agent_spec, NoRequests(agent_spec)) is None  # a fleet without a request-level side
    with pytest.raises(RuntimeError, match="not started"):
        JobEndpoint(agent_spec, endpoint_run["fleet"]).open_episode("e", seed=1, max_episode_tokens=64)


def test_agent_endpoint_job_trains_the_recorded_tokens(endpoint_run):
    step1, step2 = endpoint_run["history"]
    assert [step1["policy_version"], step2["policy_version"]] == [1, 2]
    for m in (step1, step2):
        assert m["episode/calls_mean"] == 2.0 and m["actor/update_skipped"] == 0.0
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]  # on-policy: trainer == fleet
    assert step1["episode/rewritten_fraction"] == pytest.approx(0.5) and step2["episode/rewritten_fraction"] == 0
    assert step1["rollout/sequences_trained"] == 12  # 8 episodes, the 4 rewritten ones as 2 sequences each
    served = endpoint_run["fleet"].served
    calls = {tuple(request.prompt_ids) + tuple(result.token_ids) for request, result in served}
    trained = endpoint_run["trained"]
    assert len(trained) == 12 + 8 and all(seq in calls for seq in trained)  # each: a call's prompt + completion
    greedy = [request for request, _ in served if request.temperature == 0.0]
    assert len(greedy) == 2 * 2 and all(r.top_p == 1.0 for r in greedy)  # held-out: 2 episodes x 2 calls
