"""bench/bench_modes.py: every mode's overrides make a valid demo spec with the cores given, and a run's row is read
from its metrics.jsonl as documented (steps 2..N for rates and means, all steps for the partial-rollout counts)."""

from __future__ import annotations

import json

import pytest

from bench.bench_modes import DEMO, MODES, mode_overrides, summarize
from cluster.spec import load_spec


@pytest.mark.parametrize("mode", list(MODES))
def test_bench_modes_overrides_load_for_every_mode(tmp_path, mode):
    spec = load_spec(DEMO, mode_overrides(mode, 6, tmp_path / "run", [0], [1], ["rollout.group_size=8"]))
    assert spec.rollout.mode == ("sync" if mode == "sync" else mode.split("+")[0])
    assert spec.rollout.partial_rollout == (mode == "async+partial")
    assert spec.rollout.cpu_affinity == [0] and spec.train.cpu_affinity == [1]
    assert spec.eval is None and spec.checkpoint.save_final is False and spec.metrics.port is None
    assert spec.total_steps == 6 and spec.rollout.group_size == 8 and spec.seed == load_spec(DEMO).seed


def test_bench_modes_summary_reads_the_metrics_file(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1}]  # an evaluation row is not a training step
    for step, (step_s, stale, diff, reward, resumed) in enumerate(
            [(90.0, 0.0, 1e-6, 0.5, 0), (40.0, 1.0, 2e-3, 0.1, 8), (60.0, 2.0, 4e-3, 0.3, 3)], start=1):
        rows.append({"step": step, "reward/mean": reward, "timing/step_s": step_s, "timing/generate_s": 1.0,
                     "timing/train_s": 30.0, "timing/sync_s": 2.0, "rollout/staleness_mean": stale,
                     "rollout/staleness_max": stale, "rollout/logprob_diff": diff, "actor/kl_behaviour_current": diff,
                     "rollout/partial_interrupted": 8, "rollout/partial_resumed": resumed,
                     "rollout/stale_dropped_total": 0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = summarize(tmp_path, "async+partial")
    assert row["steps"] == 3 and row["step_s"] == [90.0, 40.0, 60.0]
    assert row["step_s_mean"] == 50.0 and row["steps_per_hour"] == 72.0  # 3600 / mean of steps 2..3
    assert row["staleness_mean"] == 1.5 and row["staleness_max"] == 2.0 and row["reward_mean"] == pytest.approx(0.2)
    assert row["logprob_diff"] == pytest.approx(3e-3) and row["train_s"] == 30.0
    assert row["partial_interrupted"] == 24 and row["partial_resumed"] == 11 and row["partial_restarted"] == 0
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="has 1 training steps; the rate needs >= 2"):
        summarize(tmp_path, "sync")
