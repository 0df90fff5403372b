"""``train.lr_schedule`` on the real loop and train rank (in-process runtime, tiny model): every step trains at the
schedule's rate, and a run resumed after step N trains step N + 1 at the same learning rate, with the same AdamW
step count and the same step label, as an uninterrupted run.

The failure this guards against (reported for other trainers): a scheduler whose counter is not saved with the
checkpoint, or is stepped again on resume, so that the resumed run restarts the warmup or skips a step of the decay.
"""

from __future__ import annotations

import json

import pytest

from cluster.in_process import local_job
from cluster.loop.lr_schedule import LRSchedule
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

TOTAL, RESUME_AT = 5, 3


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _spec(model_dir: str, out, train_path: str):
    return local_spec(
        model_dir, str(out), total_steps=TOTAL,
        data={"train_path": train_path, "max_prompt_tokens": 256},
        train={"lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1, "lr": 1e-3},
        algorithm={"kl_coef": 0.0, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
        metrics={"port": None}, checkpoint={"every_steps": RESUME_AT, "save_final": False})


def _adam_steps(job) -> set[float]:
    """AdamW's step count of every parameter of the job's train rank."""
    return {float(state["step"]) for state in job.trainer.worker.optimizer.state.values()}


class StopAfter:
    """A control channel (``contract.protocols.ControlChannel``) that asks its job to stop once step ``step`` is done:
    the job reads it before each step, so the request made when ``step - 1`` steps are done ends the run after
    ``step``."""

    def __init__(self, step: int):
        self.step, self.job = step, None

    def desired_rollout_replicas(self) -> None:
        return None

    def report(self, status) -> None:
        if status["step"] == self.step - 1:
            self.job.request_stop(f"test: stop after step {self.step}")

    def close(self) -> None:
        pass


def _run(spec, resume: bool = False, stop_after: int | None = None):
    """Run a job; with ``stop_after`` the job stops cleanly after that step. Returns (history, AdamW step counts)."""
    control = StopAfter(stop_after) if stop_after is not None else None
    job = local_job(spec, progress=False, resume=resume, control=control)
    if control is not None:
        control.job = job
    with stopped_after(job):
        history = job.run()
        steps = _adam_steps(job)
    return history, steps


@pytest.fixture(scope="module")
def runs(tiny_model_dir, parity, tmp_path_factory):
    root = tmp_path_factory.mktemp("lr_resume")
    train_path = root / "train.jsonl"
    train_path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                                  for i in range(8)))
    whole, whole_steps = _run(_spec(tiny_model_dir, root / "whole", str(train_path)))
    resumed_spec = _spec(tiny_model_dir, root / "resumed", str(train_path))
    first, _ = _run(resumed_spec, stop_after=RESUME_AT)
    second, second_steps = _run(resumed_spec, resume=True)
    rows = [json.loads(line) for line in (root / "resumed" / "metrics.jsonl").read_text().splitlines()]
    return {"whole": whole, "whole_steps": whole_steps, "first": first, "second": second,
            "second_steps": second_steps, "rows": rows, "spec": resumed_spec}


def test_each_step_trains_at_the_schedules_rate(runs):
    schedule = LRSchedule.from_spec(runs["spec"].train, TOTAL)
    expected = [schedule.lr(step) for step in range(1, TOTAL + 1)]
    # warmup 1/2, 2/2; then the cosine from p = 0 in steps of 1/3, towards 0.1 x lr
    assert expected == pytest.approx([5e-4, 1e-3, 1e-3, 0.775e-3, 0.325e-3])
    assert [m["actor/lr"] for m in runs["whole"]] == pytest.approx(expected, rel=1e-12)


def test_resumed_run_continues_the_schedule_exactly(runs):
    assert len(runs["first"]) == RESUME_AT and len(runs["second"]) == TOTAL - RESUME_AT
    resumed_next, whole_next = runs["second"][0], runs["whole"][RESUME_AT]
    assert resumed_next["actor/lr"] == pytest.approx(whole_next["actor/lr"], rel=1e-12)
    assert resumed_next["policy_version"] == whole_next["policy_version"] == RESUME_AT + 1
    # AdamW's bias correction continues from the checkpoint's count: TOTAL updates either way, on every parameter
    assert runs["second_steps"] == runs["whole_steps"] == {float(TOTAL)}
    # the resumed run's first row is step N + 1 (not N + 2), and no step is logged twice
    assert [r["step"] for r in runs["rows"]] == list(range(1, TOTAL + 1))
