"""The reward-hacking guard (cluster/loop/guard.py) with a fake job, and the ``monitor`` spec section.

Rows are hand-built so the trip step and onset are known: ``actor/kl`` 0.001 until a jump, ``kl_max`` 0.5 and
``window_steps`` 1, so ``kl_band`` fires on the first step whose KL is above 0.5 and its onset is the first step of the
unbroken run of KL >= 0.25 ending there (grpo.monitor). Checkpoints are folders ``step_N`` with a
``trainer_state.json``, as the driver writes them.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.loop.checkpoint_state import open_step_logs
from cluster.loop.guard import (GUARD_STATE, LAST_GOOD, Guard, build_guard, check_resume, last_good_checkpoint,
                                monitor_config)
from cluster.loop.setup import SetupError
from cluster.sinks.metrics import MetricsLogger
from cluster.spec import MonitorSpec, SpecError, load_spec_text
from grpo.monitor import MonitorConfig

BASE = ("name: g\noutput_dir: /tmp/g\ntotal_steps: 10\ndata: {train_path: x.jsonl}\n"
        "algorithm: {rewards: {accuracy: 1.0, format: 0.2}}\n")


def _row(kl: float, fmt: float = 0.2) -> dict:
    return {"reward/accuracy": 0.1, "reward/format": fmt, "reward/mean": 0.1 + 0.2 * fmt, "actor/kl": kl,
            "response_length/mean": 100.0, "rollout/groups_sampled": 4, "rollout/group_size": 4}


class FakeJob:
    """A job as the guard sees it (``cluster.loop.guard.GuardTarget``: stop, restore a checkpoint, change a reward
    weight), with step logs, checkpoints as the driver writes them and the steps it ran."""

    def __init__(self, root: Path, spec: MonitorSpec, weights: dict[str, float]):
        self.output_dir, self.root = root, root / "checkpoints"
        self.metrics_path = root / "metrics.jsonl"
        self.root.mkdir()
        self.metrics = MetricsLogger(root, port=None, echo=False)
        self.completed: dict[int, dict] = {}
        self.step, self.resume_from, self.restores, self.messages = 0, None, 0, []
        self.stop_reason = None
        self.weights = weights
        self.guard = Guard(spec, self.root, weights, self.messages.append)

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def set_reward_weight(self, name: str, weight: float) -> None:
        self.weights[name] = weight

    def restore(self, path: Path) -> None:
        self.restores += 1
        self.resume_from = path
        self.step = json.loads((path / "trainer_state.json").read_text())["step"]
        open_step_logs(self.output_dir, self.step)
        self.metrics.reopen()
        for step in [s for s in self.completed if s > self.step]:
            del self.completed[step]

    def run_step(self, row: dict, checkpoint: bool = False) -> bool:
        """One step as the driver runs it: observe, log, checkpoint, act. Returns whether the job must stop."""
        self.step += 1
        tripped = self.guard.observe(self.step, row)
        self.completed[self.step] = row
        self.metrics.log(self.step, row)
        if checkpoint:
            folder = self.root / f"step_{self.step:06d}"
            folder.mkdir()
            (folder / "trainer_state.json").write_text(json.dumps({"step": self.step}))
        if tripped:
            self.guard.act(self, self.step, row)
        return self.stop_reason is not None


def _spec(**kw) -> MonitorSpec:
    return MonitorSpec(detectors=("kl_band",), window_steps=1, **kw)


def _run(job: FakeJob, kls: list[float], fmts: list[float] | None = None) -> int | None:
    """Steps with checkpoints on even steps; returns the step the guard stopped the job at (None: never)."""
    for i, kl in enumerate(kls):
        if job.run_step(_row(kl, (fmts or [0.2] * len(kls))[i]), checkpoint=(job.step + 1) % 2 == 0):
            return job.step
    return None


def test_spec_defaults_mirror_monitor_config():
    spec, config = MonitorSpec(), MonitorConfig()
    assert monitor_config(spec) == config
    assert {f.name for f in fields(MonitorConfig)} - set(MonitorSpec.model_fields) == {"samples_per_step"}


@pytest.mark.parametrize("field, value", [("length_drift_frac", 1.5), ("kl_max", 0), ("window_steps", 0),
                                          ("entropy_drop_frac", 1.0), ("rollback_reward_scale", 1.0),
                                          ("max_rollbacks", 0), ("detectors", "[bogus]")])
def test_out_of_range_threshold_is_refused_naming_the_field(field, value):
    with pytest.raises(SpecError, match=f"monitor.{field}"):
        load_spec_text(BASE + f"monitor: {{{field}: {value}}}\n")


def test_cross_checks_name_the_field():
    with pytest.raises(SpecError, match=r"monitor\.action.*1 <= checkpoint\.every_steps < total_steps \(10\), got 0"):
        load_spec_text(BASE + "monitor: {action: rollback}\n")
    with pytest.raises(SpecError, match=r"monitor\.action.*total_steps \(10\), got 10"):  # never before an onset
        load_spec_text(BASE + "monitor: {action: rollback}\ncheckpoint: {every_steps: 10}\n")
    with pytest.raises(SpecError, match=r"monitor\.action.*keep_last null or >= 2, got 1"):
        load_spec_text(BASE + "monitor: {action: rollback}\ncheckpoint: {every_steps: 2, keep_last: 1}\n")
    with pytest.raises(SpecError, match=r"monitor\.detectors.*distinct.*\['kl_band'\] repeated"):
        load_spec_text(BASE + "monitor: {detectors: [kl_band, kl_band]}\n")
    with pytest.raises(SpecError, match=r"monitor\.verifiable_reward.*\['accuracy', 'format'\], got 'correct'"):
        load_spec_text(BASE + "monitor: {verifiable_reward: correct}\n")
    with pytest.raises(SpecError, match=r"monitor\.shaping_rewards"):
        load_spec_text(BASE + "monitor: {shaping_rewards: [accuracy]}\n")
    spec = load_spec_text(BASE + "monitor: {action: rollback}\ncheckpoint: {every_steps: 2}\n")
    assert spec.monitor.action == "rollback" and spec.monitor.enabled
    assert load_spec_text(BASE + "monitor: {action: rollback, enabled: false}\n").monitor.enabled is False
    assert load_spec_text(BASE).monitor is None


def test_cli_refuses_rollback_without_checkpoints_before_ray(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE.replace("/tmp/g", str(tmp_path / "out")) + "monitor: {action: rollback}\n")
    assert main(["validate", str(spec)]) == 2
    assert "monitor.action" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_monitor_section_builds_no_guard(tmp_path):
    spec = load_spec_text(BASE)
    assert build_guard(spec.monitor, tmp_path, {"accuracy": 1.0}, print, None, tmp_path / "metrics.jsonl") is None


def test_warn_adds_metrics_and_logs_detector_value_and_onset(tmp_path):
    job = FakeJob(tmp_path, _spec(), {"accuracy": 1.0, "format": 0.2})
    assert _run(job, [0.001] * 5 + [0.3, 2.0, 2.0]) is None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["monitor/tripped"] for r in rows] == [0.0] * 6 + [1.0, 1.0]
    assert [r["monitor/kl_band"] for r in rows] == [0.0] * 6 + [1.0, 1.0]
    assert set(rows[0]) - set(_row(0)) == {"step", "monitor/kl_band", "monitor/tripped"}
    assert job.messages[0] == ("monitor: step 7: reward hacking suspected: kl_band fired (actor/kl=2); "
                               "onset about step 6")
    assert not (job.root / GUARD_STATE).exists() and not (job.root / LAST_GOOD).exists()


def test_stop_marks_last_checkpoint_before_onset_and_resume_refuses(tmp_path):
    job = FakeJob(tmp_path, _spec(action="stop"), {"accuracy": 1.0, "format": 0.2})
    assert _run(job, [0.001] * 5 + [0.3, 2.0, 2.0]) == 7
    # onset 6: its row was sampled by step_5's policy, so the last good is the newest checkpoint <= 4 (step_4, not 6)
    assert (job.root / LAST_GOOD).read_text() == "step_000004"
    state = json.loads((job.root / GUARD_STATE).read_text())
    assert state["stopped"] and state["trips"] == [{"step": 7, "onset_step": 6, "detectors": ["kl_band"],
                                                    "last_good": "step_000004", "action": "stop"}]
    with pytest.raises(SetupError, match=r"stopped this job at step 7 \(kl_band fired, onset about step 6; last "
                                         r"good checkpoint .*step_000004\).*--resume-past-trip"):
        check_resume(job.root, allowed=False)
    check_resume(job.root, allowed=True)  # validate: allowed, nothing written
    assert json.loads((job.root / GUARD_STATE).read_text())["stopped"]
    check_resume(job.root, allowed=True, clear=True)
    check_resume(job.root, allowed=False)  # a restart after an allowed resume does not ask again


def test_last_good_choice(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    (tmp_path / "step_000003.partial").mkdir()
    assert [last_good_checkpoint(tmp_path, onset) for onset in (3, 4, 5, 6, 8, 9)] == [
        None, tmp_path / "step_000002", tmp_path / "step_000002", tmp_path / "step_000004",
        tmp_path / "step_000006", tmp_path / "step_000006"]


def test_resume_cli_exits_2_naming_the_trip(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: g\noutput_dir: {out}\ntotal_steps: 10\nmodel: {{path: {tiny_model_dir}}}\n"
                    f"data: {{train_path: {data}}}\nmetrics: {{port: 0}}\nmonitor: {{action: stop}}\n")
    ckpt = out / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    trip = {"step": 7, "onset_step": 6, "detectors": ["kl_band"], "last_good": "step_000004", "action": "stop"}
    (out / "checkpoints" / GUARD_STATE).write_text(json.dumps({"trips": [trip], "stopped": True, "rollbacks": 0}))
    assert main(["validate", str(spec), "--resume"]) == 2
    assert "guard stopped this job at step 7" in capsys.readouterr().err
    assert main(["validate", str(spec), "--resume", "--resume-past-trip"]) == 2  # past the guard: the fake
    err = capsys.readouterr().err  # checkpoint's empty driver state is the next problem
    assert "guard stopped" not in err and "cannot restore the driver state" in err


def test_rollback_restores_reduces_offending_weight_then_stops_after_max(tmp_path):
    weights = {"accuracy": 1.0, "format": 0.2}
    job = FakeJob(tmp_path, _spec(action="rollback", max_rollbacks=1, rollback_reward_scale=0.5), weights)
    fmts = [0.2] * 5 + [0.6, 0.9]
    assert _run(job, [0.001] * 5 + [0.3, 2.0], fmts) is None  # trip at 7, onset 6 -> back to step_4
    assert job.step == 4 and job.restores == 1 and job.resume_from == job.root / "step_000004"
    assert weights == {"accuracy": 1.0, "format": 0.1}  # format rose most: the offending component, halved
    assert sorted(p.name for p in job.root.iterdir()) == [
        GUARD_STATE, LAST_GOOD, "latest", "step_000002", "step_000004", "step_000006.rollback1"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert sorted(job.completed) == [1, 2, 3, 4]
    state = json.loads((job.root / GUARD_STATE).read_text())
    assert state["rollbacks"] == 1 and not state["stopped"] and state["reward_weights"] == weights
    assert state["trips"][0]["reduced"] == "format"
    # continuing: the replayed monitor keeps the baseline; the new row carries the rollback metrics
    assert not job.run_step(_row(0.001))
    row = job.completed[5]
    assert row["monitor/rollbacks"] == 1.0 and row["monitor/reward_weight/format"] == 0.1
    assert job.run_step(_row(2.0), checkpoint=True)  # trips again at 6 (onset 6): max_rollbacks used -> stop
    state = json.loads((job.root / GUARD_STATE).read_text())
    assert state["stopped"] and state["trips"][-1]["action"] == "stop" and state["trips"][-1]["step"] == 6
    assert "1 rollback(s) used" in job.messages[-1]


def test_rollback_without_good_checkpoint_stops(tmp_path):
    job = FakeJob(tmp_path, _spec(action="rollback"), {"accuracy": 1.0, "format": 0.2})
    assert _run(job, [0.001, 2.0]) == 2  # onset 2: needs a checkpoint <= 0
    assert "cannot roll back: no checkpoint at or before step 0" in job.messages[-1]
    assert not (job.root / LAST_GOOD).exists()


@pytest.mark.parametrize("content", [
    "garbage", "", "[]", "null", '{"stopped": true, "trips": []}', '{"stopped": true, "trips": [{}]}',
    '{"trips": null}', '{"stopped": "false"}', '{"reward_weights": {"format": "x"}}', b"\xff\xfe",
])
def test_a_corrupt_guard_record_is_a_setup_error_naming_the_file(tmp_path, content):
    """A damaged guard.json stops --resume with a SetupError (exit 2 from the CLI) naming the file, whatever is in
    it, and never lets the resume through silently."""
    path = tmp_path / GUARD_STATE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for allowed in (False, True):
        with pytest.raises(SetupError, match=f"{path}: not a reward-hacking guard record"):
            check_resume(tmp_path, allowed=allowed)


def test_a_guard_record_folder_is_refused(tmp_path):
    (tmp_path / GUARD_STATE).mkdir()
    with pytest.raises(SetupError, match="not a reward-hacking guard record"):
        check_resume(tmp_path, allowed=False)


def test_saved_weights_of_rewards_the_spec_no_longer_has_are_refused(tmp_path):
    (tmp_path / GUARD_STATE).write_text(json.dumps({"trips": [], "reward_weights": {"format": 0.1, "bogus": 1.0}}))
    weights = {"accuracy": 1.0, "format": 0.2}
    with pytest.raises(SetupError, match=r"reward_weights \['bogus'\] are not in algorithm.rewards"):
        Guard(MonitorSpec(), tmp_path, weights, print, resumed=True)
    assert weights == {"accuracy": 1.0, "format": 0.2}
