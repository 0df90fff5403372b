"""The real GRPO loop (``cluster.driver.GRPOJob``) on the in-process runtime: ``local_job`` on the tiny random Llama,
2 steps in ``rollout.mode: sync`` with held-out evaluation, no Ray, no vLLM (≈ 10 s).

The prompts are a handful of arithmetic questions written here; a random model never answers them, so the job is
scored by the test reward ``parity`` (1.0 for a completion of even character count), which gives groups unequal
rewards and so a learning signal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.in_process import LocalFleet, LocalTrainer, local_job
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

EVAL_PROBLEMS = 3
EVAL_KEYS = {"eval/accuracy", "eval/n", "eval/problems", "eval/response_length_mean", "eval/truncated_fraction"}


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _write_problems(path: Path, count: int, offset: int = 0) -> str:
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
            for i in range(offset, offset + count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def job_run(tiny_model_dir, parity, tmp_path_factory):
    out = tmp_path_factory.mktemp("local_job")
    spec = local_spec(
        tiny_model_dir, str(out),
        data={"train_path": _write_problems(out / "train.jsonl", 8), "max_prompt_tokens": 256},
        algorithm={"kl_coef": 0.04, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
        eval={"data_path": _write_problems(out / "held_out.jsonl", EVAL_PROBLEMS, offset=50), "every_steps": 1,
              "max_tokens": 6},
        metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": True})
    job = local_job(spec, progress=False)
    assert isinstance(job.fleet, LocalFleet) and isinstance(job.trainer, LocalTrainer)
    with stopped_after(job):
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    workers = [json.loads(line) for line in (out / "workers.jsonl").read_text().splitlines()]
    return {"spec": spec, "history": history, "rows": rows, "workers": workers, "out": out, "job": job}


def test_every_step_trains_and_syncs_verified(job_run):
    history, spec = job_run["history"], job_run["spec"]
    assert [m["policy_version"] for m in history] == [1, 2]
    n = spec.rollout.prompts_per_step * spec.rollout.group_size
    for m in history:
        assert m["sync/verified"] is True and m["sync/engines"] == 1 and m["actor/update_skipped"] == 0.0
        assert m["rollout/sample_policy_version_min"] == m["policy_version"] - 1  # on-policy: sampled by v-1
        assert 0 < m["response_length/mean"] <= spec.rollout.max_response_tokens
        assert m["reward/mean"] * n == pytest.approx(round(m["reward/mean"] * n), abs=1e-4)  # 0/1 parity rewards
        # the fleet samples with exactly the rank's weights (step 2: after the sync of version 1)
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]


def test_eval_rows_and_worker_rows(job_run):
    rows = job_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert EVAL_KEYS <= set(rows[0]) and all(EVAL_KEYS <= set(r) for r in rows[1:])
    assert all(r["eval/n"] == EVAL_PROBLEMS and 0 < r["eval/response_length_mean"] <= 6 for r in rows)
    engine_rows = [w for w in job_run["workers"] if w.get("pool") == "rollout"]
    assert [w["step"] for w in engine_rows] == [1, 2]
    assert all(w["worker"] == "engine-0" and w["rollout/queue_depth"] == 2.0 for w in engine_rows)


def test_final_checkpoint_and_stopped_runtime(job_run):
    out = job_run["out"]
    final = out / "checkpoints" / "step_000002"
    assert (final / "model.safetensors").is_file() and (final / "trainer_state.json").is_file()
    job = job_run["job"]
    assert job.trainer.worker is None and job.fleet.model is None  # shut down by the job
