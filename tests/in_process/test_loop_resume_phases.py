"""Resume with buffered and in-flight work, from the outside (issue 30, item 6): the real loop on the in-process
runtime (tiny random Llama, ``parity`` reward) in ``rollout.mode: async`` with ``max_staleness: 2`` and partial
rollouts, B = 2 prompts per step, 4 steps over 8 prompts, a checkpoint after every step (≈ 10 s per phase).

Step 2 is held until its producer has queued step 3's batch and is in the middle of step 4's (a test fleet pauses its
second interruptible call of a step after two token steps until the loop interrupts it), so step 2's checkpoint is
taken with one batch queued and one partial round carried: it records the data position before both and 4 groups in
flight. Then the job is killed at one phase of step 3 (an exception raised by a test fleet or train rank, after the
phase did its work where it has any):

- ``generate``: step 3's producer call (it continues the carried round of step 4);
- ``score``: that call's reward scoring, as the fleet hands the scorer its groups;
- ``train``: step 3's update, after the train rank applied it;
- ``sync``: step 3's weight sync, after the fleet received the new weights;
- ``checkpoint``: step 3's checkpoint, after the train rank wrote its files (a ``.partial`` folder is left).

A fresh job resumes from step 2's checkpoint (its policy version, data position and in-flight count) and runs to the
end. Every prompt is trained exactly once, in draw order (``trained_prompts.jsonl``: [0, 1], [2, 3], [4, 5], [6, 7]),
the resumed steps sample the in-flight groups again (``rollout/inflight_resampled`` 4) and the policy versions
continue (3, 4). No flag in production code: the faults are a :class:`LocalFleet` and a :class:`LocalTrainer`
subclass written here.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.in_process import LocalFleet, LocalTrainer, local_job
from cluster.loop.checkpoints import TRAINER_STATE
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

PHASES = ("generate", "score", "train", "sync", "checkpoint")
STEPS, CHECKPOINT = 4, 2  # killed during step CHECKPOINT + 1, resumed from step CHECKPOINT's checkpoint
HOLD_AFTER_TOKENS = 2     # a held call pauses after this many token steps
WAIT_S = 60.0             # bound on every wait between the threads of the test (never reached when all is well)


class Killed(RuntimeError):
    """The job's process dies here (what it held in memory is lost; what it wrote stays)."""


class KillSwitch:
    """Kills the job at the first hit of ``phase`` once ``after`` checkpoints have been written by the train rank."""

    def __init__(self, phase: str, after: int):
        self.phase, self.after = phase, after
        self.saves = 0
        self.fired = False

    def hit(self, phase: str) -> None:
        if phase == self.phase and self.saves >= self.after and not self.fired:
            self.fired = True
            raise Killed(f"killed in {phase} (after checkpoint {self.saves})")


class PhasedFleet(LocalFleet):
    """A LocalFleet that (1) kills at ``generate``/``score``/``sync`` through its :class:`KillSwitch` and (2) holds
    the second interruptible call of each producer epoch after a few token steps until the loop interrupts it
    (``holding`` is set while it waits), so a train step can wait for a batch queued and a round in flight."""

    def __init__(self, spec, switch: KillSwitch):
        super().__init__(spec)
        self.switch = switch
        self.holding = threading.Event()
        self._wake = threading.Event()
        self._calls: dict[int, int] = {}
        self._hold_epoch: int | None = None
        self._checks = 0

    def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
        self.switch.hit("generate")
        if interrupt_epoch is not None:
            calls = self._calls[interrupt_epoch] = self._calls.get(interrupt_epoch, 0) + 1
            if calls == 2:
                self._wake.clear()
                self._hold_epoch, self._checks = interrupt_epoch, 0

        def scored(groups):
            on_groups(groups)
            self.switch.hit("score")

        return super().generate(requests, scored if on_groups is not None else None, record, recover,
                                interrupt_epoch)

    def interrupted(self, interrupt_epoch):
        if interrupt_epoch is not None and interrupt_epoch == self._hold_epoch:
            self._checks += 1
            if self._checks > HOLD_AFTER_TOKENS:
                self.holding.set()
                deadline = time.monotonic() + WAIT_S
                while not super().interrupted(interrupt_epoch) and time.monotonic() < deadline:
                    self._wake.wait(deadline - time.monotonic())
        return super().interrupted(interrupt_epoch)

    def interrupt(self, epoch):
        super().interrupt(epoch)
        self._wake.set()

    def sync_policy(self):
        self.holding.clear()  # the step's producer has been joined: the next step holds afresh
        report = super().sync_policy()
        self.switch.hit("sync")
        return report


class PhasedTrainer(LocalTrainer):
    """A LocalTrainer that kills at ``train`` (after the update) and ``checkpoint`` (after writing its files), counts
    checkpoints for the :class:`KillSwitch`, and at step ``hold_at`` trains only once the fleet holds a call (one
    batch queued, one round in flight). ``on_save`` is called after each checkpoint's train-rank part."""

    def __init__(self, spec, switch: KillSwitch, fleet: PhasedFleet, hold_at: int, on_save):
        super().__init__(spec)
        self.switch, self.fleet, self.hold_at, self.on_save = switch, fleet, hold_at, on_save
        self.steps = 0

    def train_step(self, per_rank, num_tokens, num_sequences):
        self.steps += 1
        if self.steps == self.hold_at:
            assert self.fleet.holding.wait(WAIT_S), f"step {self.steps}: the producer never held a call in flight"
        result = super().train_step(per_rank, num_tokens, num_sequences)
        self.switch.hit("train")
        return result

    def save_checkpoint(self, folder, checkpoint=None):
        super().save_checkpoint(folder, checkpoint)
        self.switch.hit("checkpoint")
        self.switch.saves += 1
        self.on_save(self.switch.saves)


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _spec(model_dir: str, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}) + "\n"
                            for i in range(2 * STEPS)))
    return local_spec(model_dir, str(out), total_steps=STEPS,
                      data={"train_path": str(data), "max_prompt_tokens": 256, "shuffle": False},
                      rollout={"mode": "async", "max_staleness": 2, "partial_rollout": True,
                               "max_response_tokens": 8},
                      algorithm={"kl_coef": 0.0, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
                      metrics={"port": None}, checkpoint={"every_steps": 1, "save_final": True})


def _rows(out: Path, name: str) -> list[dict]:
    path = out / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("phase", PHASES)
def test_killed_in_any_phase_after_a_checkpoint_with_work_in_flight_resumes_training_every_prompt_once(
        tiny_model_dir, parity, tmp_path, phase):
    spec = _spec(tiny_model_dir, tmp_path)
    switch = KillSwitch(phase, after=CHECKPOINT)
    fleet = PhasedFleet(spec, switch)
    in_flight: dict[int, tuple[int, bool]] = {}  # checkpoint → (batches queued, a round carried)
    trainer = PhasedTrainer(spec, switch, fleet, hold_at=CHECKPOINT,
                            on_save=lambda n: in_flight.setdefault(n, (len(job.schedule.queued),
                                                                       job.producer.carried() is not None)))
    job = GRPOJob(spec, fleet=fleet, trainer=trainer, progress=False)
    with pytest.raises(Killed, match=f"killed in {phase}"):
        with stopped_after(job):
            job.run()
    assert in_flight[CHECKPOINT] == (1, True), in_flight  # step 3's batch queued, step 4's round carried
    root = tmp_path / "checkpoints"
    state = json.loads((root / f"step_{CHECKPOINT:06d}" / TRAINER_STATE).read_text())
    assert state["step"] == CHECKPOINT and state["policy_version"] == CHECKPOINT and state["inflight_groups"] == 4
    assert state["sampler"]["offset"] == 2 * CHECKPOINT and state["pending_prompts"] == []
    assert not (root / f"step_{CHECKPOINT + 1:06d}").exists()
    assert (root / f"step_{CHECKPOINT + 1:06d}.partial").is_dir() == (phase == "checkpoint")
    before = [r["step"] for r in _rows(tmp_path, "trained_prompts.jsonl")]
    assert before == ([1, 2, 3] if phase == "checkpoint" else [1, 2])  # step 3 logged only once it completed

    with stopped_after(local_job(spec, progress=False, resume=True)) as resumed:
        assert (resumed.step, resumed.policy_version) == (CHECKPOINT, CHECKPOINT)
        again = resumed.run()
    assert [m["policy_version"] for m in again] == [3, 4]
    assert again[0]["rollout/inflight_resampled"] == 4 and again[1]["rollout/inflight_resampled"] == 0
    rows = _rows(tmp_path, "trained_prompts.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["prompts"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    trained = [p for r in rows for p in r["prompts"]]
    assert sorted(trained) == list(range(2 * STEPS))  # every prompt once
    assert [r["step"] for r in _rows(tmp_path, "metrics.jsonl")] == [1, 2, 3, 4]
    assert (root / f"step_{STEPS:06d}" / TRAINER_STATE).is_file()
