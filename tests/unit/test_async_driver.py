"""``GRPOJob`` in ``rollout.mode: async`` over stand-in collaborators (``tests/stand_ins.py``: groups stamped with the
version the last sync gave them, one version per train step) whose train step ends only once the producer has filled
the queue. Checks the driver's wiring of :class:`AsyncSchedule`: staleness up to
``max_staleness``, the staleness histogram, the audit in ``trained_prompts.jsonl``, the checkpoint's data position of
the trained batches only (every queued batch in flight), the resume that draws the queued prompts again, and a stale
head dropped with the queue: its prompts drawn again in the same order, counted, none lost, none trained twice."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

from cluster.driver import GRPOJob
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.spec import load_spec_text
from tests.stand_ins import StandInFleet, StandInTrainer


def _spec(tmp_path: Path, model: str, steps: int, k: int, every: int):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(2 * steps)))
    return load_spec_text(
        f"output_dir: {tmp_path / 'out'}\ntotal_steps: {steps}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {train}, shuffle: false}}\nmetrics: {{port: null}}\n"
        f"rollout: {{mode: async, max_staleness: {k}, prompts_per_step: 2, group_size: 2}}\n"
        f"checkpoint: {{every_steps: {every}, save_final: false}}\n")


def _job(spec, resume=False):
    """The job over the stand-ins; returns (job, fleet, trained: per train step, the trainer's version)."""
    fleet, trained = StandInFleet(), []
    k, total = spec.rollout.max_staleness, spec.total_steps

    def on_train(trainer):
        # end only once the producer has queued as many batches as the bound and the run allow (at most 10 s)
        want, pause = min(k, total - job.step), threading.Event()
        for _ in range(2000):
            if len(job.schedule.queued) >= want:
                break
            pause.wait(0.005)
        trained.append(job.policy_version)

    job = GRPOJob(spec, fleet=fleet, trainer=StandInTrainer(on_train), progress=False, resume=resume)
    return job, fleet, trained


def _prompts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]


def test_async_driver_staleness_histogram_checkpoint_and_resume(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path, tiny_model_dir, steps=4, k=2, every=2)
    job, fleet, trained = _job(spec)
    try:
        history = job.run()
    finally:
        job.close()
    assert [m["policy_version"] for m in history] == [1, 2, 3, 4] and trained == [0, 1, 2, 3]
    # batches 2, 3 queued during step 1 (version 0), batch 4 during step 2 (version 1)
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 2.0, 2.0]
    assert [[m[f"rollout/staleness_hist/{s}"] for s in range(3)] for m in history] == [
        [4, 0, 0], [0, 4, 0], [0, 0, 4], [0, 0, 4]]
    assert [m["rollout/queued_batches"] for m in history] == [2, 2, 1, 0]
    assert [m["rollout/stale_dropped"] for m in history] == [0] * 4
    assert [(name.startswith("async-producer"), version, recover) for name, version, recover in fleet.calls] == [
        (False, 0, True), (True, 0, False), (True, 0, False), (True, 1, False)]
    out = Path(spec.output_dir)
    rows = _prompts(out)
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [0, 0], [1, 1]]
    assert [r["prompts"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    state = json.loads((out / "checkpoints" / "step_000002" / TRAINER_STATE).read_text())
    # batches 3 and 4 were queued: the position is the one before batch 3 was drawn
    assert state["step"] == 2 and state["inflight_groups"] == 4
    assert state["sampler"]["offset"] == 4 and state["pending_prompts"] == []

    shutil.rmtree(out / "checkpoints" / "step_000004")  # resume from step 2's
    (out / "checkpoints" / "latest").write_text("step_000002")
    resumed, fleet2, trained2 = _job(spec, resume=True)
    try:
        again = resumed.run()
    finally:
        resumed.close()
    assert [m["policy_version"] for m in again] == [3, 4] and trained2 == [2, 3]
    assert again[0]["rollout/inflight_resampled"] == 4 and again[0]["rollout/staleness_max"] == 0.0
    assert again[1]["rollout/inflight_resampled"] == 0 and again[1]["rollout/staleness_max"] == 1.0
    rows2 = _prompts(out)
    assert [r["step"] for r in rows2] == [1, 2, 3, 4] and [r["prompts"] for r in rows2] == [r["prompts"] for r in rows]
    assert [r["sample_versions"] for r in rows2[2:]] == [[2, 2], [2, 2]]


def test_async_driver_stale_head_dropped_prompts_drawn_again_and_counted(tmp_path, tiny_model_dir):
    """After step 1 (batches 2 and 3 queued, sampled by version 0) the trainer and engines are moved to version 3
    (as a trainer taking several versions in one step would): step 2 drops both batches (4 groups), rewinds the data
    position and samples prompts 2, 3 again; step 3 trains prompts 4, 5. Each prompt is trained once, in order."""
    spec = _spec(tmp_path, tiny_model_dir, steps=3, k=2, every=0)
    job, fleet, _ = _job(spec)
    history = []
    job.start()
    try:
        for step in (1, 2, 3):
            job.step = step
            history.append(job.run_step())
            if step == 1:
                assert len(job.schedule.queued) == 2
                job.versions.restore(3)
                fleet.version = job.trainer.version = 3
            if step == 2:
                job.save_checkpoint()  # batch 3 queued: in flight
    finally:
        job.close()
    assert [m["rollout/stale_dropped"] for m in history] == [0, 4, 0]
    assert [m["rollout/stale_dropped_total"] for m in history] == [0, 4, 4]
    assert history[1]["rollout/staleness_max"] == 0.0 and history[2]["rollout/staleness_max"] == 1.0
    rows = _prompts(Path(spec.output_dir))
    assert [r["prompts"] for r in rows] == [[0, 1], [2, 3], [4, 5]]
    assert [r["sample_versions"] for r in rows] == [[0, 0], [3, 3], [3, 3]]
    resumed, _, _ = _job(spec, resume=True)  # from step 2's checkpoint: the count and batch 3 in flight
    assert resumed.step == 2 and resumed.schedule.stale_dropped_total == 4
    assert resumed.schedule.inflight_resampled == 2
