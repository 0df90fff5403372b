"""Preemption from the outside (issue 37, item 7): a tiny in-process job (tests/preempt_job.py: the tiny random Llama,
``parity`` reward, 4 steps over four prompts, ``rollout.mode: sync``) in a fresh interpreter sends itself a real
SIGTERM at one phase of one step; it must exit with code 75 and one line saying where the latest complete checkpoint
is, never a traceback; then ``resume=True`` (``--resume``) in this process runs the job to its end, and every metrics
row and every trained prompt equals the uninterrupted run's, step by step (wall-clock figures aside).

- start-up: nothing trained, nothing written; the resume starts from step 0.
- step 2's generation: the step is abandoned; the checkpoint holds step 1 (written by the preemption:
  ``checkpoint.every_steps: 0``). (Scoring, dynamic-sampling rounds: the same window; tests/preempt_job.py can send
  the signal there too, ``phase: score``.)
- step 2's update: the step is finished; the checkpoint holds step 2. A second SIGTERM arrives while that checkpoint
  is written: one line, the checkpoint completes.
- step 2's periodic checkpoint (``checkpoint.every_steps: 1``): it completes and is not written again.
- ``checkpoint.on_preempt.deadline_s`` passes while the preemption checkpoint of step 3 is held (periodic checkpoints
  every 2 steps): the watchdog exits with 75 and one line; ``step_000003.partial`` is never taken for a checkpoint;
  step 2's stays the latest and the resume from it equals the uninterrupted run.
- a SIGKILL while that checkpoint is being written: the same, without the line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.loop.checkpoints import latest_checkpoint
from cluster.loop.preemption import PREEMPTED_EXIT_CODE
from tests.job_runs import assert_same_metrics, run_to_end
from tests.reference_job import reference_spec

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
BASE = (f"total_steps={STEPS}", "metrics.port=null", "checkpoint.every_steps=0")


@pytest.fixture(scope="module")
def four_prompts(gsm8k_train_path, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "four.jsonl"
    with open(gsm8k_train_path) as f:
        path.write_text("".join(next(f) for _ in range(4)))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, four_prompts, parity_registered, tmp_path_factory) -> Path:
    """The output folder of the job run to its end without a signal."""
    from cluster.in_process import local_job

    out = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(local_job(reference_spec(tiny_model_dir, four_prompts, out, *BASE), progress=False))
    return out


def _child(model: str, data: Path, out: Path, overrides=(), **fault) -> dict:
    return {"model": model, "data": str(data), "out": str(out), "overrides": [*BASE, *overrides], **fault}


def _run_child(config: dict, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.preempt_job", json.dumps(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _resume_and_compare(config: dict, uninterrupted: Path) -> None:
    """Resume the child's job in this process and compare every row with the uninterrupted run's."""
    from cluster.in_process import local_job

    out = Path(config["out"])
    spec = reference_spec(config["model"], Path(config["data"]), out, *config["overrides"])
    run_to_end(local_job(spec, progress=False, resume=True))
    got, ref = _rows(out, "metrics.jsonl"), _rows(uninterrupted, "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for g, r in zip(got, ref):
        assert sorted(g) == sorted(r), f"step {g['step']}: other keys"
    assert_same_metrics(got, ref)
    assert [r["prompts"] for r in _rows(out, "trained_prompts.jsonl")] == \
        [r["prompts"] for r in _rows(uninterrupted, "trained_prompts.jsonl")]


def _one_line_exit(done: subprocess.CompletedProcess) -> str:
    """The child exited with the preemption code and no traceback; returns its stderr."""
    assert done.returncode == PREEMPTED_EXIT_CODE, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize("phase, checkpoint, overrides", [
    ("start", 0, ()),
    ("generate", 1, ()),
    ("train", 2, ()),
    ("checkpoint", 2, ("checkpoint.every_steps=1",)),
])
def test_preempt_mid_step_exits_75_and_resumes_to_the_uninterrupted_metrics(
        tiny_model_dir, four_prompts, uninterrupted, tmp_path, phase, checkpoint, overrides):
    config = _child(tiny_model_dir, four_prompts, tmp_path / "out", overrides, phase=phase, step=2,
                    second_sigterm=phase == "train")
    err = _one_line_exit(_run_child(config))
    root = tmp_path / "out" / "checkpoints"
    latest = latest_checkpoint(root)
    assert (latest.name if latest else None) == (f"step_{checkpoint:06d}" if checkpoint else None)
    assert not list(root.glob("*.partial"))
    last = err.strip().splitlines()[-1]
    if checkpoint:
        written = "latest complete" if phase == "checkpoint" else "wrote"
        assert f"{written} checkpoint {latest} (step {checkpoint}); continue with --resume" in last, last
    else:
        assert "no checkpoint yet (a resume starts from step 0)" in last, last
    if phase == "generate":
        assert "step 2 abandoned before its update" in err
    if phase == "train":  # the second signal while the checkpoint was written: said in one line, nothing else
        assert "SIGTERM again (2 received): ignored" in err
    logged = [r["step"] for r in _rows(tmp_path / "out", "metrics.jsonl")] if checkpoint else []
    assert logged == list(range(1, checkpoint + 1))  # the steps finished before the signal (and the one it finished)
    _resume_and_compare(config, uninterrupted)


def test_preempt_deadline_passed_mid_checkpoint_exits_75_and_keeps_the_previous_checkpoint(
        tiny_model_dir, four_prompts, uninterrupted, tmp_path):
    config = _child(tiny_model_dir, four_prompts, tmp_path / "out",
                    ("checkpoint.every_steps=2", "checkpoint.on_preempt.deadline_s=3"), phase="train", step=3,
                    hold_save_s=60)
    started = time.monotonic()
    err = _one_line_exit(_run_child(config))
    assert time.monotonic() - started < 60  # ended by the deadline, not by the held save
    last = err.strip().splitlines()[-1]
    root = tmp_path / "out" / "checkpoints"
    assert last.startswith("[grpo-cluster] preemption: checkpoint.on_preempt.deadline_s=3 s passed since SIGTERM "
                           "and the checkpoint was not complete"), last
    assert f"the latest complete checkpoint is {root / 'step_000002'}" in last and "exiting with code 75" in last
    assert (root / "step_000003.partial").is_dir()  # what the train rank wrote; never resumed from
    assert latest_checkpoint(root) == root / "step_000002"
    _resume_and_compare(config, uninterrupted)


def test_preempt_sigkill_mid_checkpoint_leaves_the_previous_checkpoint_the_latest(
        tiny_model_dir, four_prompts, uninterrupted, tmp_path):
    out = tmp_path / "out"
    config = _child(tiny_model_dir, four_prompts, out, ("checkpoint.every_steps=2",), phase="train", step=3,
                    hold_save_s=120)
    child = subprocess.Popen([sys.executable, "-m", "tests.preempt_job", json.dumps(config)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (out / "saving").is_file() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "saving").is_file(), "the preemption checkpoint never started"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    root = out / "checkpoints"
    assert (root / "step_000003.partial").is_dir() and latest_checkpoint(root) == root / "step_000002"
    _resume_and_compare(config, uninterrupted)
