"""``GRPOJob`` with ``rollout.partial_rollout`` (async, max_staleness 1) over stand-in collaborators: engines whose
fresh producer calls run until interrupted (as a batch whose longest completion would outlast the train step), returning
every completion ``"interrupted"`` after 2 tokens; continued calls add 3 tokens of the engines' current version.
Checks the driver's wiring: each step's producer call is interrupted (not awaited) and carried over, the next step
continues it on the new weights (token versions span two versions, staleness 1 from the oldest token), the
``rollout/partial_*`` metrics, every prompt trained once in order, and the checkpoint taken while a round is carried
over: position before its prompts, its groups in flight, sampled again from scratch on resume."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import torch

from cluster.driver import GRPOJob
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.spec import load_spec_text
from contract.messages import GroupResult
from tests.stand_ins import StandInFleet, StandInTrainer
from tests.unit.test_async_driver import _prompts

WAIT_S = 20.0


class InterruptibleFleet(StandInFleet):
    """Engines at ``version`` (the last sync's). A fresh interruptible call blocks until ``interrupt`` with its epoch
    (at most ``WAIT_S``), then returns 2 tokens per completion, ``"interrupted"``; a call continuing groups
    (``resume_from``) adds 3 tokens per interrupted completion at once; other calls return 5 tokens at once.
    ``calls``: (thread name, interrupt_epoch, resumed?) per call; ``interrupts``: epochs."""

    def __init__(self):
        super().__init__()
        self.cond = threading.Condition()
        self.interrupted_epoch = -1

    def interrupt(self, epoch):
        with self.cond:
            self.interrupts.append(epoch)
            self.interrupted_epoch = max(self.interrupted_epoch, epoch)
            self.cond.notify_all()

    def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
        resumed = any(q.resume_from is not None for q in requests)
        with self.cond:
            self.calls.append((threading.current_thread().name, interrupt_epoch, resumed))
            self.cond.notify_all()
        if interrupt_epoch is not None and not resumed:
            with self.cond:
                assert self.cond.wait_for(lambda: self.interrupted_epoch >= interrupt_epoch, timeout=WAIT_S)
            groups = [self._group(q, [[], []], "interrupted", 2) for q in requests]
        elif resumed:
            groups = [self._group(q, q.resume_from.response_ids, "length", 3, q.resume_from) for q in requests]
        else:
            groups = [self._group(q, [[], []], "length", 5) for q in requests]
        if on_groups is not None:
            on_groups(groups)
        return groups

    def _group(self, q, prefixes, reason, new, prior=None):
        ids = [p + [7] * new for p in prefixes]
        versions = [(prior.versions_of(i) if prior else []) + [self.version] * new for i in range(len(prefixes))]
        return GroupResult(q.group_id, q.prompt_ids, ids, [torch.zeros(len(x)) for x in ids], [reason] * len(ids),
                           ["x" * len(x) for x in ids], min(v for vs in versions for v in vs), versions)


def _spec(tmp_path: Path, model: str, steps: int):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(2 * steps)))
    return load_spec_text(
        f"output_dir: {tmp_path / 'out'}\ntotal_steps: {steps}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {train}, shuffle: false}}\nmetrics: {{port: null}}\n"
        "rollout: {mode: async, max_staleness: 1, partial_rollout: true, prompts_per_step: 2, group_size: 2}\n"
        "checkpoint: {every_steps: 2, save_final: false}\n")


def _job(spec, resume=False):
    """The job over the stand-ins; the stand-in train step ends once the producer's call of the step has started
    (none on the last step)."""
    fleet = InterruptibleFleet()

    def on_train(trainer):
        if job.step < spec.total_steps:
            epoch = job.producer.partial.epoch
            with fleet.cond:
                assert fleet.cond.wait_for(lambda: any(name.startswith("async-producer") and e == epoch
                                                       for name, e, _ in fleet.calls), timeout=WAIT_S)

    job = GRPOJob(spec, fleet=fleet, trainer=StandInTrainer(on_train), progress=False, resume=resume)
    return job, fleet


def test_partial_rollout_driver_carries_over_resumes_and_checkpoints(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path, tiny_model_dir, steps=4)
    job, fleet = _job(spec)
    try:
        history = job.run()
    finally:
        job.close()
    assert [m["policy_version"] for m in history] == [1, 2, 3, 4]
    # steps 1-3 interrupt the producer's call for the next step (2 groups x 2 completions); steps 2-4 continue them
    assert [m["rollout/partial_interrupted"] for m in history] == [4, 4, 4, 0]
    assert [m["rollout/partial_resumed"] for m in history] == [0, 4, 4, 4]
    assert [m["rollout/partial_carried_groups"] for m in history] == [2, 2, 2, 0]
    assert [m["rollout/partial_restarted"] for m in history] == [0] * 4
    assert fleet.interrupts == [1, 2, 3]
    # 2 of each continued completion's 5 tokens are one version older than its newest
    assert [m["rollout/partial_older_token_fraction"] for m in history] == [0.0, 0.4, 0.4, 0.4]
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/inflight_resampled"] for m in history] == [0] * 4
    assert [(name.startswith("async-producer"), epoch, resumed) for name, epoch, resumed in fleet.calls] == [
        (False, None, False), (True, 1, False), (False, None, True), (True, 2, False), (False, None, True),
        (True, 3, False), (False, None, True)]
    out = Path(spec.output_dir)
    rows = _prompts(out)
    assert [r["prompts"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # each prompt once, in order
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [1, 1], [2, 2]]  # the oldest token's version
    state = json.loads((out / "checkpoints" / "step_000002" / TRAINER_STATE).read_text())
    # step 3's round was carried over (in flight): the position is the one before its prompts were drawn
    assert state["step"] == 2 and state["inflight_groups"] == 2
    assert state["sampler"]["offset"] == 4 and state["pending_prompts"] == []

    shutil.rmtree(out / "checkpoints" / "step_000004")
    (out / "checkpoints" / "latest").write_text("step_000002")
    resumed, fleet2 = _job(spec, resume=True)
    try:
        again = resumed.run()
    finally:
        resumed.close()
    assert [m["policy_version"] for m in again] == [3, 4]
    assert again[0]["rollout/inflight_resampled"] == 2 and again[0]["rollout/partial_resumed"] == 0
    assert again[0]["rollout/staleness_max"] == 0.0  # sampled again from scratch on version 2
    rows2 = _prompts(out)
    assert [r["step"] for r in rows2] == [1, 2, 3, 4] and [r["prompts"] for r in rows2] == [r["prompts"] for r in rows]
