"""``GRPOJob`` in ``rollout.mode: one_step_off`` over stand-in collaborators (``tests/stand_ins.py``: groups stamped
with the version the last sync gave them, one version per train step). Checks the driver's wiring of the schedule:
staleness 0 then 1, the next batch generated in the worker thread while the step trains, the audit in
``trained_prompts.jsonl``, the checkpoint's data position of the trained batches only, and the resume that draws the
in-flight prompts again (none lost, none trained twice). ``tests/ray/test_loop_modes.py`` runs the real loop."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from cluster.driver import GRPOJob
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.spec import load_spec_text
from tests.stand_ins import StandInFleet, StandInTrainer


def _spec(tmp_path: Path, model: str, steps: int = 3):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(6)))
    return load_spec_text(
        f"output_dir: {tmp_path / 'out'}\ntotal_steps: {steps}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {train}}}\nmetrics: {{port: null}}\n"
        "rollout: {mode: one_step_off, max_staleness: 1, prompts_per_step: 2, group_size: 2}\n"
        "checkpoint: {every_steps: 2, save_final: false}\n")


def _run(spec, resume=False):
    """Run the job over the stand-ins; returns (job, history, fleet, per train step: (the trainer's version, the
    generate calls made in the worker thread by the time it ended))."""
    trained = []
    fleet = StandInFleet()

    def worker_calls() -> int:
        return sum(name.startswith("one-step-off") for name, _, _ in fleet.calls)

    def on_train(trainer):
        # the worker thread generates the next batch meanwhile: wait (at most 5 s) until it has, so a schedule that
        # generated only after training would show fewer calls here
        before, pause = worker_calls(), threading.Event()
        for _ in range(500):
            if worker_calls() > before or job.step == spec.total_steps:
                break
            pause.wait(0.01)
        trained.append((job.policy_version, worker_calls()))

    job = GRPOJob(spec, fleet=fleet, trainer=StandInTrainer(on_train), progress=False, resume=resume)
    try:
        history = job.run()
    finally:
        job.close()
    return job, history, fleet, trained


def _prompts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]


def test_one_step_off_driver_staleness_overlap_checkpoint_and_resume(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path, tiny_model_dir)
    job, history, fleet, trained = _run(spec)
    assert [m["policy_version"] for m in history] == [1, 2, 3] and fleet.syncs == 3
    assert trained == [(0, 1), (1, 2), (2, 2)]  # batches 2 and 3 generated while steps 1 and 2 trained
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0]
    assert [m["rollout/inflight_resampled"] for m in history] == [0, 0, 0]
    # batch 1 in the main thread (may recover engines); batches 2 and 3 in the worker thread, on the version the
    # step trains from, with engine recovery deferred
    assert [(name.startswith("one-step-off"), version, recover) for name, version, recover in fleet.calls] == [
        (False, 0, True), (True, 0, False), (True, 1, False)]
    out = Path(spec.output_dir)
    rows = _prompts(out)
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [1, 1]]
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]
    state = json.loads((out / "checkpoints" / "step_000002" / TRAINER_STATE).read_text())
    assert state["step"] == 2 and state["inflight_groups"] == 2
    assert state["sampler"]["offset"] == 4 and state["pending_prompts"] == []  # step 3's prompts not counted drawn

    resumed, again, fleet2, trained2 = _run(spec, resume=True)
    assert [m["policy_version"] for m in again] == [3] and trained2 == [(2, 0)]
    assert again[0]["rollout/inflight_resampled"] == 2 and again[0]["rollout/staleness_max"] == 0.0
    assert [(version, recover) for _, version, recover in fleet2.calls] == [(2, True)]  # after the restore
    rows2 = _prompts(out)
    assert [r["step"] for r in rows2] == [1, 2, 3] and rows2[2]["prompts"] == rows[2]["prompts"]
    assert rows2[2]["sample_versions"] == [2, 2]
