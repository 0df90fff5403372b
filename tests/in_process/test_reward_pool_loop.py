"""Issue #27 item 3, the reward pool in the real loop (``cluster.driver.GRPOJob``) on the in-process runtime:

- the own-task example (a jsonl with ``prompt`` + two extra columns, rewards in a .py next to the spec) with
  ``reward_pool.workers: 2``: the spec-named reward functions are loaded again in two worker processes, which score
  every completion with its row's columns, and the run's metrics equal those of the same run scored in the driver
  (the tiny random Llama; ≈ 60 s);
- ``rollout.mode: one_step_off`` over stand-in collaborators: the schedule's producer thread submits to the pool and
  collects from it, the ``reward_pool/*`` figures reach the metrics rows, and the job's end stops the workers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.in_process import local_job, local_reward_pool
from cluster.spec import load_spec, load_spec_text
from tests.job_runs import run_to_end
from tests.stand_ins import StandInFleet, StandInTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_task"

SPY = '''
import json, os

def record(prompts, completions, answer, difficulty):
    """Weight 0: records what each call got and the process that ran it, scores nothing."""
    with open(os.environ["POOL_SPY"], "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "prompts": prompts, "answer": answer, "difficulty": difficulty,
                             "n": len(completions)}) + "\\n")
    return [0.0] * len(completions)
'''
COMPARED = ("reward/", "response_length/", "groups/", "actor/loss", "actor/kl", "policy_version")


def _run(task: Path, workers: int, model: str) -> tuple[list[dict], list[dict]]:
    spy = task / f"calls_{workers}.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("POOL_SPY", str(spy))
    spec = load_spec(task / "spec.yaml", [
        f"model.path={model}", f"output_dir={task / f'out_{workers}'}", "total_steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=8", "train.num_threads=1",
        'algorithm.rewards={"reward.py:correct": 1.0, "reward.py:within_budget": 0.2, "spy.py:record": 0.0}',
        "eval=null", "checkpoint.keep_best=false", "metrics.port=null",
        f"reward_pool={{workers: {workers}, batch_size: 3, num_cpus_per_worker: 0}}" if workers
        else "reward_pool={workers: 0}"])
    try:
        history = run_to_end(local_job(spec, progress=False))
    finally:
        mp.undo()
    return history, [json.loads(line) for line in spy.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    task = tmp_path_factory.mktemp("own_task_pool")
    for name in ("train.jsonl", "test.jsonl", "reward.py", "spec.yaml"):
        shutil.copy2(EXAMPLE / name, task / name)
    (task / "spy.py").write_text(SPY)
    return {workers: _run(task, workers, tiny_model_dir) for workers in (0, 2)}


def test_reward_pool_loop_workers_score_the_own_task_with_its_columns(runs):
    history, calls = runs[2]
    by_prompt = {json.loads(line)["prompt"]: json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text()
                 .splitlines()}
    pids = {c["pid"] for c in calls}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2  # in the worker processes, never in the driver
    assert all(c["n"] <= 3 for c in calls)  # reward_pool.batch_size
    seen = 0
    for call in calls:
        for prompt, answer, difficulty in zip(call["prompts"], call["answer"], call["difficulty"]):
            assert (answer, difficulty) == (by_prompt[prompt]["answer"], by_prompt[prompt]["difficulty"])
            seen += 1
    assert seen == 2 * 2 * 4  # every completion of both steps
    assert [m["reward_pool/workers"] for m in history] == [2.0, 2.0]
    assert all(m["reward_pool/lost_rows"] == 0 and m["reward/infra_failed"] == 0 for m in history)
    assert all(c["pid"] == os.getpid() for c in runs[0][1])  # the driver scored the other run


def test_reward_pool_loop_metrics_equal_scoring_in_the_driver(runs):
    (inline, _), (pooled, _) = runs[0], runs[2]
    assert len(inline) == len(pooled) == 2
    for a, b in zip(inline, pooled):
        keys = [k for k in a if k.startswith(COMPARED)]
        assert len(keys) > 10 and "reward/reward.py:correct" in keys
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert not any(k.startswith("reward_pool/") for k in a)  # the driver's scoring adds no pool figures


def length_reward(completions, references):
    """Stand-in fleet texts are 'x' * (1 + i): 1.0 for an even length."""
    return [float(len(c) % 2 == 0) for c in completions]


def test_reward_pool_loop_one_step_off_producer_thread_uses_the_pool(tmp_path, tiny_model_dir):
    from tests.registered import temporarily_registered

    registered = temporarily_registered("pool_length", length_reward)
    next(registered)
    try:
        train = tmp_path / "train.jsonl"
        train.write_text("".join(json.dumps({"question": f"What is {i}?", "answer": f"#### {i}"}) + "\n"
                                 for i in range(8)))
        spec = load_spec_text(
            f"output_dir: {tmp_path / 'out'}\ntotal_steps: 3\nmodel: {{path: {tiny_model_dir}}}\n"
            f"data: {{train_path: {train}}}\nmetrics: {{port: null}}\ncheckpoint: {{save_final: false}}\n"
            "rollout: {mode: one_step_off, max_staleness: 1, prompts_per_step: 2, group_size: 4}\n"
            "algorithm: {rewards: {pool_length: 1.0}}\nreward_pool: {workers: 1, batch_size: 2}\n")
        pool = local_reward_pool(spec)
        job = GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), reward_pool=pool, progress=False)
        try:
            history = job.run()
            workers = [w.pid for w in pool._slots]
        finally:
            job.close()
            job.shutdown()
    finally:
        next(registered, None)
    assert len(history) == 3
    assert all(m["reward/mean"] == 0.5 and m["reward/infra_failed"] == 0 for m in history)  # lengths 1-4: half even
    assert all(m["reward_pool/workers"] == 1.0 and m["reward_pool/lost_calls"] == 0 for m in history)
    threads = {thread for thread, *_ in job.fleet.calls}
    assert "MainThread" in threads and len(threads) >= 2  # batches made in the producer thread were scored too
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
