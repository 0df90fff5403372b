"""The end-of-run summary (``cluster.loop.summary``) built from ``metrics.jsonl`` rows: the held-out verdict and its
rule, time by phase, goodput and each pool's shares, warnings and guard trips, and the outputs that exist; the demo's
recorded run gives the figures docs/results.md reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.loop.summary import build_summary, held_out_change, summary_text, write_summary

DEMO = Path(__file__).resolve().parents[2] / "bench" / "data" / "demo_cpu_15_steps.metrics.jsonl"


def _eval(step: int, acc: float, low: float, high: float) -> dict:
    return {"step": step, "eval/accuracy": acc, "eval/accuracy_ci_low": low, "eval/accuracy_ci_high": high,
            "eval/n": 205.0}


@pytest.mark.parametrize(("after", "verdict"), [
    ((0.263, 0.208, 0.328), "improved beyond noise"), ((0.10, 0.066, 0.15), "within noise"),
    ((0.01, 0.002, 0.035), "worse beyond noise")])
def test_report_held_out_verdict_is_non_overlapping_wilson_intervals(after, verdict):
    change = held_out_change([_eval(0, 0.073, 0.045, 0.117), {"step": 1, "policy_version": 1}, _eval(15, *after)])
    assert change["verdict"] == verdict and change["before"]["step"] == 0 and change["after"]["step"] == 15
    assert "do not overlap" in change["rule"]


def test_report_held_out_with_one_or_no_evaluation():
    assert held_out_change([{"step": 1, "policy_version": 1}]) is None
    one = held_out_change([_eval(0, 0.1, 0.05, 0.2)])
    assert one["after"] is None and one["verdict"] == "one evaluation only"


def _rows() -> list[dict]:
    return [json.loads(line) for line in DEMO.read_text().splitlines()]


def test_report_summary_of_the_recorded_demo(tmp_path):
    rows = _rows()
    (tmp_path / "metrics.jsonl").write_text(DEMO.read_text())
    s = build_summary(rows, name="demo_cpu", output_dir=tmp_path, total_steps=15, wall_s=1004.0,
                      steps_run=range(1, 16), accounting_s=0.0118)
    assert s["steps"] == 15 and s["held_out"]["verdict"] == "improved beyond noise"
    steps_s = sum(r["timing/step_s"] for r in rows if r["step"])
    assert s["time"]["steps_s"] == pytest.approx(steps_s) and s["time"]["other_s"] == pytest.approx(
        1004.0 - steps_s - s["time"]["eval_s"])
    g = s["goodput"]
    assert g["trained_tokens"] == sum(r.get("goodput/trained_tokens", 0) for r in rows) and g["cores"] == [2.0]
    assert g["tokens_per_s"] == pytest.approx(g["trained_tokens"] / g["wall_s"]) and g["wall_s"] == pytest.approx(
        steps_s, rel=0.02)
    for name, pool in g["pools"].items():  # the parts add up over the run too
        assert pool["busy_s"] + pool["waiting_s"] + pool["idle_s"] == pytest.approx(pool["capacity_s"]), name
    assert g["pools"]["train"]["capacity_s"] == pytest.approx(2 * g["wall_s"])
    assert s["health_warnings"] == {} and s["guard"] == {"tripped": [], "detectors": {}, "rollbacks": 0}
    json_path, txt_path = write_summary(tmp_path, s)
    assert json.loads(json_path.read_text()) == s
    text = txt_path.read_text()
    assert text.startswith("[grpo-cluster] done: 15 steps of 15 (demo_cpu)")
    assert "7.3 % [4.5 %, 11.7 %] (n=205, step 0) -> 26.3 % [20.8 %, 32.8 %]" in text
    assert "health warnings: none" in text and "guard: never tripped" in text and "train x2 busy" in text
    listed = [Path(o["path"]).name for o in s["outputs"]]
    assert listed == ["metrics.jsonl", "summary.json", "summary.txt"]  # what exists, and the summary itself


def test_report_warnings_trips_and_a_resumed_run():
    rows = [{"step": 1, "policy_version": 1, "timing/step_s": 10.0, "health/stall": 0.0, "health/value/stall": 1.0,
             "health/warnings": 0.0, "monitor/tripped": 0.0, "monitor/kl_band": 0.0},
            {"step": 2, "policy_version": 2, "timing/step_s": 40.0, "health/stall": 1.0, "health/value/stall": 4.0,
             "health/flat_run": 1.0, "health/warnings": 2.0, "monitor/tripped": 1.0, "monitor/kl_band": 1.0,
             "monitor/reward_weight/format": 0.5, "monitor/rollbacks": 1.0}]
    s = build_summary(rows, name="x", output_dir="/nonexistent", total_steps=4, wall_s=30.0, steps_run=[2],
                      stop_reason="the guard stopped it")
    assert s["health_warnings"] == {"stall": [2], "flat_run": [2]}
    assert s["guard"] == {"tripped": [2], "detectors": {"kl_band": [2]}, "rollbacks": 1}
    assert s["time"]["other_s"] is None  # step 1 ran in an earlier process
    assert s["goodput"]["steps"] == 0 and s["held_out"] is None
    text = summary_text(s)
    assert "stopped early: the guard stopped it" in text and "stall at step 2; flat_run at step 2" in text
    assert "tripped at step 2 (kl_band: step 2), 1 rollback(s)" in text and "goodput: no step recorded" in text


def test_report_outputs_list_only_what_was_written_and_both_drawing_commands(tmp_path):
    """A run with no checkpoint saved (checkpoint.every_steps 0, save_final false) leaves an empty checkpoints folder
    and an empty logs folder: neither is listed as an output. A saved checkpoint is. The text names both commands
    that draw the run, ``grpo-cluster plot`` and ``grpo-cluster report``."""
    (tmp_path / "metrics.jsonl").write_text(DEMO.read_text())
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoints" / "step_000002.partial").mkdir()  # an interrupted save is no checkpoint either
    s = build_summary(_rows(), name="demo_cpu", output_dir=tmp_path, total_steps=15, wall_s=1.0, steps_run=[])
    assert [Path(o["path"]).name for o in s["outputs"]] == ["metrics.jsonl", "summary.json", "summary.txt"]
    text = summary_text(s)
    assert f"grpo-cluster plot {tmp_path}" in text and f"grpo-cluster report {tmp_path}" in text
    (tmp_path / "checkpoints" / "step_000001").mkdir()
    (tmp_path / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{}")
    (tmp_path / "logs" / "engine-1.log").write_text("")
    s = build_summary(_rows(), name="demo_cpu", output_dir=tmp_path, total_steps=15, wall_s=1.0, steps_run=[])
    listed = {Path(o["path"]).name: o["what"] for o in s["outputs"]}
    assert list(listed) == ["metrics.jsonl", "summary.json", "summary.txt", "logs", "checkpoints"]
    assert "step_000001" in listed["checkpoints"]
