"""``grpo-cluster submit`` to a head started from the venv without activating it (``.venv/bin/ray start --head``:
the ``python`` on the head's PATH is not the venv's). Issue 12: the job died in a deep ``ModuleNotFoundError:
torch``. Now ``--python`` defaults to this interpreter for a cluster on this machine, and an interpreter without the
project fails in one line. Starts a Ray head and a 1-step tiny job (≈ 1.5 min): run under the heavy-run lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ops import jobs
from tests.ray.test_submit import EXAMPLE, PARITY, cli
from tests.ray_head import RayHead


@pytest.fixture(scope="module")
def bare_head():
    head = RayHead(num_cpus=4, venv_on_path=False)
    try:
        yield head
    finally:
        head.stop()


def test_default_interpreter_runs_the_job(bare_head, tiny_model_dir, gsm8k_train_path, tmp_path):
    out = tmp_path / "out"
    submitted = cli("submit", EXAMPLE, "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}",
                    "--set", PARITY, "--set", "metrics.port=null", "--set", "total_steps=1",
                    "--set", "checkpoint.save_final=false", "--import", "tests.parity_reward",
                    "--address", bare_head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    assert f"--python {sys.executable} (the cluster at 127.0.0.1 is on this machine" in submitted.stderr
    job_id = submitted.stdout.strip()
    client = jobs.connect(bare_head.dashboard)
    details = jobs.wait_for_job(client, job_id, timeout_s=600)
    logs = client.get_job_logs(job_id)
    assert str(details.status) == "SUCCEEDED", logs[-3000:]
    assert details.entrypoint.startswith(f"{sys.executable} -m cluster.cli run")
    assert (out / "metrics.jsonl").read_text().count("\n") == 1


def test_interpreter_without_the_project_fails_in_one_line(bare_head, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    submitted = cli("submit", EXAMPLE, "--set", f"output_dir={tmp_path / 'out'}", "--python", python,
                    "--address", bare_head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    client = jobs.connect(bare_head.dashboard)
    details = jobs.wait_for_job(client, job_id, timeout_s=120)
    logs = client.get_job_logs(job_id)
    assert str(details.status) == "FAILED", logs
    assert "Traceback" not in logs, logs
    printed = logs.split("Running entrypoint for job", 1)[1].splitlines()[1:]  # after Ray's own preamble
    assert [line for line in printed if line.strip()] == [
        f"grpo-cluster: missing dependency: torch, transformers, ray, pydantic, yaml, safetensors, prometheus_client, "
        f"tqdm, filelock, psutil (interpreter {python}); submit with --python PATH (an interpreter on the cluster "
        f"that has the project's dependencies) or --pip REQUIREMENT"], logs
