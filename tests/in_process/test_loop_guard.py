"""The reward-hacking guard in the loop, on the in-process runtime (``cluster.in_process.local_job``: tiny random
Llama, one train rank; seconds): ``tests/tiny_cpu.yaml`` with a hackable reward (``short``: pays for short answers)
beside the verifiable one, ``monitor.action: rollback`` and one rollback allowed; then ``action: warn``. (The guard
acts through the loop, which needs neither Ray nor vLLM.)

What is under test is the wiring (detector → metrics → rollback through the resume machinery → stop → resume
refusal), not the thresholds (measured on recorded sequences in tests/unit/test_grpo_monitor.py): a random tiny model
moves its entropy by ~1e-7 per step, so ``entropy_band`` is given a hair trigger (1e-9) and fires on the first step
after its 2-step baseline, step 3 (onset 3). The last good checkpoint is then ``step_000001`` (onset - 2), the run
rolls back to it with the ``short`` weight halved, trips again at step 3 and stops (``max_rollbacks: 1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts
from tests.registered import temporarily_registered

MONITOR = ('monitor={"action": "%s", "detectors": ["entropy_band"], "baseline_steps": 2, "window_steps": 1, '
           '"entropy_drop_frac": 1e-9, "entropy_rise_frac": 1e-9, "max_rollbacks": 1, "rollback_reward_scale": 0.5}')


def short_reward(completions: list[str], references: list[str]) -> list[float]:
    """16 / (16 + characters): pays for short answers, whatever they say (the hack)."""
    return [16 / (16 + len(c)) for c in completions]


@pytest.fixture
def short_registered():
    yield from temporarily_registered("short", short_reward)


def _spec(tiny_model_dir, gsm8k_train_path, folder, action: str, *overrides: str):
    """The reference tiny job (six prompts) scored by accuracy + ``short``, with the hair-trigger guard."""
    return reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, folder), folder / "out",
                          'algorithm.rewards={"accuracy": 1.0, "short": 1.0}', "metrics.port=null", "total_steps=5",
                          "checkpoint.every_steps=1", MONITOR % action, *overrides)


def test_guard_rolls_back_then_stops_and_resume_refuses(tiny_model_dir, gsm8k_train_path, short_registered,
                                                        tmp_path):
    from cluster.in_process import local_job
    from cluster.loop.guard import GUARD_STATE, LAST_GOOD
    from cluster.loop.setup import SetupError
    from cluster.sinks.metrics import read_metrics_jsonl

    spec = _spec(tiny_model_dir, gsm8k_train_path, tmp_path, "rollback")
    out = tmp_path / "out"
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
    root = out / "checkpoints"
    state = json.loads((root / GUARD_STATE).read_text())
    assert [(t["step"], t["onset_step"], t["action"], t["last_good"]) for t in state["trips"]] == [
        (3, 3, "rollback", "step_000001"), (3, 3, "stop", "step_000001")]
    assert state["stopped"] and state["rollbacks"] == 1 and state["trips"][0]["reduced"] == "short"
    assert state["reward_weights"] == {"accuracy": 1.0, "short": 0.5}
    assert (root / LAST_GOOD).read_text() == "step_000001"
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_000001", "step_000002", "step_000002.rollback1", "step_000003", "step_000003.rollback1"]
    rows = read_metrics_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["monitor/tripped"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["monitor/entropy_band"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["monitor/rollbacks"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["monitor/reward_weight/short"] for r in rows] == [1.0, 0.5, 0.5]
    assert [m["monitor/rollbacks"] for m in history] == [0.0, 1.0, 1.0]

    with pytest.raises(SetupError, match="guard stopped this job at step 3"):
        local_job(spec, progress=False, resume=True)
    resumed = local_job(spec, progress=False, resume=True, resume_past_trip=True)
    try:
        assert resumed.step == 3 and resumed.scoring.weights == {"accuracy": 1.0, "short": 0.5}
        assert not json.loads((root / GUARD_STATE).read_text())["stopped"]
    finally:
        resumed.close()


def test_guard_warns_and_the_run_goes_on(tiny_model_dir, gsm8k_train_path, short_registered, tmp_path, capsys):
    """``action: warn``: the same trip at step 3 is a status line naming the detector; the job runs its 5 steps, no
    checkpoint is marked and nothing is rolled back or stopped."""
    from cluster.in_process import local_job
    from cluster.loop.guard import GUARD_STATE, LAST_GOOD

    spec = _spec(tiny_model_dir, gsm8k_train_path, tmp_path, "warn")
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
        assert job.stop_reason is None
    assert [m["policy_version"] for m in history] == [1, 2, 3, 4, 5]
    assert [m["monitor/tripped"] for m in history][:3] == [0.0, 0.0, 1.0]
    assert "monitor/rollbacks" not in history[0]  # rollback's own figures only with action: rollback
    warnings = [line for line in capsys.readouterr().err.splitlines() if "entropy_band" in line]
    assert warnings and "step 3" in warnings[0], warnings
    root = tmp_path / "out" / "checkpoints"
    assert not (root / LAST_GOOD).exists() and not (root / GUARD_STATE).exists()
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_00000{s}" for s in range(1, 6)]
