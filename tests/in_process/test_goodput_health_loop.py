"""Goodput, health warnings and the end-of-run summary in the real loop (``cluster.driver.GRPOJob``) on the
in-process runtime with the tiny random Llama (≈ 15 s):

- ``sync`` run, 3 steps, a reward worker process, held-out evaluation before and after, a Prometheus endpoint: the
  pools' parts add up to workers × ``timing/step_s`` on every step; the injected health case (a random model never
  answers, so every group is flat; ``health.flat_run_steps: 2``) warns at steps 2 and 3 on the console, in
  ``metrics.jsonl`` and on the endpoint; ``summary.json``/``summary.txt`` hold the run's figures.
- ``one_step_off`` run, 2 steps: the parts add up when generation overlaps training.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from cluster.in_process import local_job
from tests.local_runtime import local_spec
from tests.prometheus_scrape import scrape
from tests.unit.test_goodput import check_adds_up


def _problems(path: Path, count: int, offset: int = 0) -> str:
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
            for i in range(offset, offset + count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _run(spec) -> dict:
    """Run the job to its end, scrape its endpoint before it closes; returns what the checks read."""
    job = local_job(spec, progress=False)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            history = job.run()
        samples = scrape(job.metrics.url) if job.metrics.url else {}
    finally:
        job.close()
        job.shutdown()
    out = Path(spec.output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"history": history, "rows": rows, "stderr": err.getvalue(), "samples": samples, "out": out,
            "job": job, "name": spec.name}


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("goodput_sync")
    spec = local_spec(
        tiny_model_dir, str(out), name="goodput_sync", total_steps=3,
        data={"train_path": _problems(out / "train.jsonl", 12), "max_prompt_tokens": 256},
        algorithm={"kl_coef": 0.04, "rewards": {"accuracy": 1.0}},  # never answered: every group flat
        reward_pool={"workers": 1},
        eval={"data_path": _problems(out / "held_out.jsonl", 3, offset=50), "max_tokens": 4},
        health={"flat_run_steps": 2}, metrics={"port": 0}, checkpoint={"every_steps": 0, "save_final": False})
    return _run(spec)


@pytest.fixture(scope="module")
def overlapped_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("goodput_one_step_off")
    spec = local_spec(
        tiny_model_dir, str(out), name="goodput_overlap", total_steps=2,
        data={"train_path": _problems(out / "train.jsonl", 12), "max_prompt_tokens": 256},
        rollout={"mode": "one_step_off"}, metrics={"port": None},
        checkpoint={"every_steps": 0, "save_final": False})
    return _run(spec)


def test_goodput_parts_add_up_to_the_step_wall_in_process(sync_run):
    steps = [r for r in sync_run["rows"] if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert not check_adds_up(row, row["timing/step_s"]), (row["step"], check_adds_up(row, row["timing/step_s"]))
        assert {k[5:-8] for k in row if k.startswith("time/") and k.endswith("_workers")} == {
            "driver", "rollout", "train", "reward"}
        # in this runtime the engine samples and the rank trains in the driver's thread, while it waits on them
        assert row["time/driver_waiting_s"] >= row["time/rollout_busy_s"] + row["time/train_busy_s"] > 0
        assert row["time/rollout_waiting_s"] == pytest.approx(row["timing/sync_s"], rel=0.02, abs=1e-3)
        assert row["time/reward_workers"] == 1 and row["time/reward_busy_s"] > 0
        assert row["goodput/trained_tokens"] > 0 and row["goodput/cores"] >= 1
        assert row["goodput/tokens_per_s"] == pytest.approx(row["goodput/trained_tokens"] / row["timing/step_s"],
                                                            rel=0.02)


def test_goodput_parts_add_up_when_generation_overlaps_training(overlapped_run):
    steps = [r for r in overlapped_run["rows"] if r["step"] >= 1]
    assert len(steps) == 2
    for row in steps:
        assert not check_adds_up(row, row["timing/step_s"]), check_adds_up(row, row["timing/step_s"])
        assert row["time/driver_waiting_s"] >= row["time/train_busy_s"] > 0
    assert steps[0]["time/rollout_busy_s"] > 0  # step 1 generates its own batch and step 2's


def test_health_warning_goes_to_console_metrics_and_prometheus(sync_run):
    rows = {r["step"]: r for r in sync_run["rows"]}
    assert [rows[s]["health/flat_run"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[2]["health/value/flat_run"] == 2.0 and rows[2]["health/threshold/flat_run"] == 2.0
    assert rows[2]["health/warnings"] >= 1.0
    assert "health: step 2: flat_run: steps in a row without a learning signal" in sync_run["stderr"]
    assert "(threshold 2)" in sync_run["stderr"]
    driver = f'job="{sync_run["name"]}",pool="driver",worker="driver"'
    samples = sync_run["samples"]
    assert samples[f"grpo_health_flat_run{{{driver}}}"] == 1.0
    assert samples[f"grpo_health_threshold_flat_run{{{driver}}}"] == 2.0
    assert samples[f'grpo_time_reward_busy_s{{job="{sync_run["name"]}",pool="reward",worker="driver"}}'] > 0
    assert f'grpo_goodput_tokens_per_s{{{driver}}}' in samples


def test_end_of_run_summary_report_in_the_run_folder(sync_run):
    out = sync_run["out"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == sync_run["job"].summary
    assert summary["steps"] == 3 and summary["held_out"]["before"]["step"] == 0
    assert summary["held_out"]["after"]["step"] == 3 and summary["held_out"]["verdict"] == "within noise"
    assert summary["health_warnings"]["flat_run"] == [2, 3] and summary["guard"]["tripped"] == []
    g = summary["goodput"]
    assert g["steps"] == 3 and g["trained_tokens"] == sum(r["goodput/trained_tokens"] for r in sync_run["history"])
    assert set(g["pools"]) == {"driver", "rollout", "train", "reward"}
    assert summary["time"]["other_s"] is not None and summary["time"]["eval_s"] > 0
    listed = {Path(o["path"]).name for o in summary["outputs"]}
    assert {"metrics.jsonl", "summary.json", "summary.txt", "spec.yaml"} <= listed
    text = (out / "summary.txt").read_text()
    assert text.startswith("[grpo-cluster] done: 3 steps of 3 (goodput_sync)")
    for part in ("held-out accuracy: ", "within noise", "goodput: ", "time by pool", "flat_run at steps 2, 3",
                 "guard: ", str(out / "metrics.jsonl")):
        assert part in text, part
