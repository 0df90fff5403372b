"""bench/bench_policy_losses.py: every loss's command makes a valid demo spec that differs from the others only in the
policy loss and its clip bounds, and a run's held-out curve and step means are read from its metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from bench.bench_policy_losses import DEMO, LOSSES, command, main, summarize
from cluster.spec import load_spec


@pytest.mark.parametrize("loss", list(LOSSES))
def test_each_losss_command_is_a_valid_demo_spec(tmp_path, loss):
    cmd = command(loss, 20, 5, 2, tmp_path)
    assert cmd[1:6] == ["-m", "cluster.cli", "run", str(DEMO), "--no-progress"] and cmd[6::2] == ["--set"] * len(
        cmd[6::2])
    spec = load_spec(DEMO, cmd[7::2])
    assert spec.algorithm.policy_loss == loss and spec.total_steps == 20 and spec.algorithm.num_iterations == 2
    assert spec.eval.every_steps == 5 and spec.eval.at_start and spec.eval.at_end
    assert spec.output_dir == str(tmp_path / loss) and spec.seed == load_spec(DEMO).seed
    others = {k: v for k, v in spec.algorithm.model_dump().items() if k not in ("policy_loss", "clip_eps_low",
                                                                                 "clip_eps_high", "num_iterations")}
    ppo = load_spec(DEMO, command("ppo", 20, 5, 2, tmp_path)[7::2]).algorithm.model_dump()
    assert others == {k: ppo[k] for k in others}  # the runs differ only in the loss and its clip bounds


def test_the_summary_reads_the_held_out_curve_and_the_step_means(tmp_path, capsys):
    run = tmp_path / "gspo"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/accuracy_ci_low": 0.05, "eval/accuracy_ci_high": 0.2,
             "eval/n": 205},
            {"step": 1, "reward/mean": 0.2, "actor/clip_fraction": 0.1, "actor/entropy": 1.0, "timing/step_s": 60.0},
            {"step": 2, "reward/mean": 0.4, "actor/clip_fraction": 0.3, "actor/entropy": 0.8, "timing/step_s": 50.0,
             "eval/accuracy": 0.2, "eval/accuracy_ci_low": 0.15, "eval/accuracy_ci_high": 0.26, "eval/n": 205}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(run)
    assert [p["step"] for p in summary["curve"]] == [0, 2] and summary["curve"][1]["accuracy"] == 0.2
    assert summary["steps"] == 2 and summary["reward/mean"] == pytest.approx(0.3)
    assert summary["actor/clip_fraction"] == pytest.approx(0.2) and summary["timing/step_s"] == 55.0
    assert main(["--report", str(tmp_path), "--losses", "gspo"]) == 0
    out = capsys.readouterr().out
    assert "0.200 [0.150, 0.260] n=205" in out and out.strip().splitlines()[-1].startswith("{")
