"""Issue #27, tried as a new user would: the own-task example (a jsonl with ``prompt`` + two extra columns, reward
functions in a .py next to the spec) through the real loop (``cluster.driver.GRPOJob``) on the in-process runtime
(``cluster.in_process.local_job``: the tiny random Llama, no Ray, no vLLM; ≈ 15 s), with a recording reward that shows
every completion reached the rewards with its row's prompt and extra columns, and the held-out evaluation scored by the
spec's file reward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.in_process import local_job
from cluster.spec import load_spec
from tests.job_runs import run_to_end

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_task"

SPY = '''
import json, os

def record(prompts, completions, answer, difficulty):
    """Weight 0: records what the loop passed (one JSON line per call), scores nothing."""
    with open(os.environ["OWN_TASK_SPY"], "a") as fh:
        fh.write(json.dumps({"prompts": prompts, "answer": answer, "difficulty": difficulty,
                             "n": len(completions)}) + "\\n")
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def own_task_run(tiny_model_dir, tmp_path_factory):
    task = tmp_path_factory.mktemp("own_task")
    for name in ("train.jsonl", "test.jsonl", "reward.py", "spec.yaml"):
        shutil.copy2(EXAMPLE / name, task / name)
    (task / "spy.py").write_text(SPY)
    calls = task / "calls.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("OWN_TASK_SPY", str(calls))
    spec = load_spec(task / "spec.yaml", [
        f"model.path={tiny_model_dir}", f"output_dir={task / 'out'}", "total_steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=8", "train.num_threads=1",
        'algorithm.rewards={"reward.py:correct": 1.0, "reward.py:within_budget": 0.2, "spy.py:record": 0.0}',
        "eval.max_tokens=6", "metrics.port=null"])
    try:
        history = run_to_end(local_job(spec, progress=False))
    finally:
        mp.undo()
    rows = [json.loads(line) for line in (task / "out" / "metrics.jsonl").read_text().splitlines()]
    return {"history": history, "rows": rows, "calls": [json.loads(line) for line in calls.read_text().splitlines()]}


def test_own_task_runs_in_the_loop_and_rewards_get_the_extra_columns(own_task_run):
    history, calls = own_task_run["history"], own_task_run["calls"]
    assert [m["policy_version"] for m in history] == [1, 2]
    by_prompt = {json.loads(line)["prompt"]: json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text()
                 .splitlines()}
    seen = 0
    for call in calls:
        for prompt, answer, difficulty in zip(call["prompts"], call["answer"], call["difficulty"]):
            row = by_prompt[prompt]  # the prompt as the data gave it
            assert (answer, difficulty) == (row["answer"], row["difficulty"])
            seen += 1
    assert seen == 2 * 2 * 4  # every completion of both steps: 2 prompts x G=4 each
    for m in history:
        assert {"reward/reward.py:correct", "reward/reward.py:within_budget", "reward/infra_failed"} <= set(m)
        assert m["reward/infra_failed"] == 0


def test_own_task_held_out_is_scored_by_the_file_reward(own_task_run):
    evals = [r for r in own_task_run["rows"] if "eval/accuracy" in r]
    assert len(evals) == 2 and all(r["eval/problems"] == 8.0 for r in evals)  # at start and at the end
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
