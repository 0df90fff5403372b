"""Issue #27, tried as a new user would, on a real Ray head (``ray start --head`` on 127.0.0.1, tests/ray_head.py): the
own-task example (a jsonl with ``prompt`` + two extra columns, reward functions in a .py next to the spec) copied to a
folder outside the project, submitted with ``grpo-cluster submit``: the reward files travel with the job (they are
not in the uploaded project folder), the job succeeds, and a recording reward shows every completion reached the
rewards with its row's extra columns (≈ 2 minutes; run under ``flock /tmp/grpo-heavy.lock``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_task"

SPY = '''
import json, os

def record(completions, answer, difficulty):
    """Weight 0: records the columns the job passed (one JSON line per call), scores nothing."""
    with open(os.environ["OWN_TASK_SPY"], "a") as fh:
        fh.write(json.dumps({"answer": answer, "difficulty": difficulty, "n": len(completions)}) + "\\n")
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def head():
    from tests.ray_head import RayHead

    cluster = RayHead(num_cpus=4)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_own_task_submit_ships_the_reward_files_and_the_job_succeeds(head, tiny_model_dir, tmp_path):
    task = tmp_path / "my_task"  # the user's folder: not inside the uploaded project
    task.mkdir()
    for name in ("train.jsonl", "test.jsonl", "reward.py", "spec.yaml"):
        shutil.copy2(EXAMPLE / name, task / name)
    (task / "spy.py").write_text(SPY)
    calls = tmp_path / "calls.jsonl"
    rewards = 'algorithm.rewards={"reward.py:correct": 1.0, "reward.py:within_budget": 0.2, "spy.py:record": 0.0}'
    overrides = [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'out'}", "total_steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=8",
                 "train.num_threads=1", "eval.max_tokens=6", rewards]
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "submit", str(task / "spec.yaml"),
                             *(x for o in overrides for x in ("--set", o)), "--env", f"OWN_TASK_SPY={calls}",
                             "--address", head.dashboard, "--follow"], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{result.stdout[-3000:]}"
    assert "SUCCEEDED" in result.stderr and "step 2 | v2" in result.stdout
    rows = {json.loads(line)["answer"]: json.loads(line)["difficulty"]
            for line in (EXAMPLE / "train.jsonl").read_text().splitlines()}
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    pairs = [(a, d) for call in recorded for a, d in zip(call["answer"], call["difficulty"])]
    assert len(pairs) == 2 * 2 * 4  # every completion of both steps
    assert all(rows[a] == d for a, d in pairs)  # each with its own row's extra columns
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/reward.py:correct" in m for m in metrics)
