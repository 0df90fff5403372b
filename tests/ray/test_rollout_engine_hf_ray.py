"""``rollout.engine: hf`` under Ray (issue 36, item 1): the reference tiny job (tests/reference_job.py) for one step
with the transformers engine in the engine actor instead of vLLM, one FSDP2 rank, stop strings on. The actor receives
the trainer's weights through the same sync group and transports as the vLLM engine (checksums verified), and the
trainer's logprobs of the sampled tokens equal the engine's; afterwards the fleet serves requests through the actor
(request-level generation). Starts no vLLM engine (tests/conftest.py NO_ENGINE).
"""

from __future__ import annotations

import json

import pytest

from contract.requests import TokenRequest
from tests.job_runs import stopped_after


@pytest.fixture(scope="module")
def hf_run(local_ray, tiny_model_dir, parity_registered, tmp_path_factory):
    from cluster.ray_shell.runtime import build_job
    from tests.reference_job import reference_spec

    base = tmp_path_factory.mktemp("hf_engine")
    data = base / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"}) + "\n"
                            for i in range(4)))
    spec = reference_spec(tiny_model_dir, data, base / "out", "rollout.engine=hf",
                          "total_steps=1", "train.world_size=1", "train.num_cpus_per_worker=1",
                          'rollout.stop=["e"]', "metrics.port=null", "checkpoint.save_final=false")
    with stopped_after(build_job(spec, progress=False)) as job:
        history = job.run()
        engine_pid = job.fleet.rollout.infos[0].pid
        prompt = tuple(job.prompt_ids[0])
        futures = [job.fleet.submit(TokenRequest(f"r{i}", prompt, 8, seed=i, group_id=i % 2)) for i in range(6)]
        served = [f.result(120) for f in futures]
    return {"spec": spec, "history": history, "engine_pid": engine_pid, "served": served}


def test_rollout_engine_hf_trains_a_step_under_ray_with_verified_sync(hf_run):
    import os

    (step,) = hf_run["history"]
    assert step["policy_version"] == 1 and step["sync/verified"] is True and step["sync/engines"] == 1
    assert step["actor/update_skipped"] == 0.0
    assert step["rollout/logprob_diff"] < 2e-5, step["rollout/logprob_diff"]  # the engine holds the trainer's weights
    assert 0 < step["response_length/mean"] < hf_run["spec"].rollout.max_response_tokens  # stop strings ended some
    assert hf_run["engine_pid"] != os.getpid()  # the engine ran in its actor


def test_rollout_engine_hf_serves_requests_under_ray(hf_run):
    """Request-level generation through the fleet: six requests in flight at once in the actor's ``requests``
    concurrency group, served on the synced weights (policy version 1)."""
    served = hf_run["served"]
    assert [x.request_id for x in served] == [f"r{i}" for i in range(6)]
    assert all(x.engine == "engine-0" and x.token_versions == [1] * len(x.token_ids) for x in served)
    assert all(0 < len(x.token_ids) <= 8 and len(x.logprobs) == len(x.token_ids) for x in served)
