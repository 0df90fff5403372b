"""The two example agents written with the openai client (examples/code_agent, examples/tool_calc_agent) train a step
on the in-process runtime: their spec files as written, shrunk to the tiny random Llama (one step, B = 2 x G = 2,
short calls, two held-out episodes before and after). Their episodes run in local agent workers against the real
agent endpoint (the agents import the sandbox and the reward functions there), and the steps' metrics carry the
agents' parts as ``reward/<name>`` and ``eval/reward/<name>``. A random model writes no working code, so the
rewards are zeros; what is checked is that the whole path runs. ~40 s here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.in_process import local_job
from cluster.spec import load_spec
from tests.job_runs import stopped_after

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHRINK = ["total_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_response_tokens=8",
          "train.world_size=1", "train.num_threads=1", "eval.limit=2", "metrics.port=null",
          "checkpoint.save_final=false", "ray.num_cpus=null", "rollout.agent_pool.timeout_s=120"]


@pytest.mark.parametrize("example, parts", [
    ("code_agent", {"accuracy", "first_try", "attempts", "ran"}),
    ("tool_calc_agent", {"accuracy", "tool_calls", "tool_errors"}),
])
def test_agent_examples_train_a_step_in_process(tiny_model_dir, tmp_path, example, parts):
    if example == "code_agent" and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (the coding agent runs its tests in the sandbox)")
    spec = load_spec(EXAMPLES / example / "spec.yaml",
                     [*SHRINK, f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                      "rollout.agent_options.max_tokens=8"])
    with stopped_after(local_job(spec, progress=False)) as job:
        job.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("step") == 1 and "reward/agent" in r]
    assert trained and {f"reward/{p}" for p in parts} <= set(trained[0])
    assert trained[0]["reward/infra_failed"] == 0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2 and all({f"eval/reward/{p}" for p in parts} <= set(r) for r in evals)
    assert all(r["eval/n"] == 2 for r in evals)
