"""``grpo-cluster submit / status / logs / stop`` against a real Ray head (``ray start --head`` on 127.0.0.1): the tiny
job is submitted through the Ray Jobs API, its logs are followed to SUCCEEDED, and its Prometheus endpoint is scraped
while it runs (≈ 2 minutes). Run under the heavy-run lock: ``flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest
tests/ray/test_submit.py``.

The head is started from the venv without activating it (``.venv/bin/ray start --head``: the ``python`` on the head's
PATH is not the venv's). Issue 12: the job died in a deep ``ModuleNotFoundError: torch``. Now ``--python`` defaults to
this interpreter for a cluster on this machine (the submitted tiny job shows it, and runs with it), and an interpreter
without the project fails in one line.

The random tiny model never solves GSM8K, so the job is scored by the test reward ``parity`` (tests/parity_reward.py,
imported by the job with ``--import``), which makes the reward series move.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.ops import jobs
from tests.prometheus_scrape import scrape
from tests.ray_head import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
PARITY = 'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}'


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``grpo-cluster ARGS`` in a subprocess (from the repository root), output captured."""
    return subprocess.run([sys.executable, "-m", "cluster.cli", *map(str, args)], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def driver_value(samples: dict[str, float], name: str) -> float | None:
    """The driver's sample of gauge ``name`` (label sets vary: take the one without a worker or worker="driver")."""
    for key, value in samples.items():
        if key == name or (key.startswith(name + "{") and ('worker=' not in key or 'worker="driver"' in key)):
            return value
    return None


@pytest.fixture(scope="module")
def head():
    """A 4-CPU head whose PATH does not lead to this venv (``RayHead(venv_on_path=False)``)."""
    from tests.ray_head import RayHead

    cluster = RayHead(num_cpus=4, venv_on_path=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(head):
    from cluster.ops.jobs import connect

    return connect(head.dashboard)


def test_submit_follow_and_scrape(head, client, tiny_model_dir, gsm8k_train_path, tmp_path):
    out, port, steps = tmp_path / "out", free_port(), 4
    submitted = cli("submit", EXAMPLE, "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}",
                    "--set", PARITY, "--set", f"metrics.port={port}", "--set", f"total_steps={steps}",
                    "--import", "tests.parity_reward", "--address", head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    assert "INFO" not in submitted.stderr, submitted.stderr  # Ray's upload chatter is silenced
    # The head's PATH has no python with the project: the default interpreter is this one (issue 12).
    assert f"--python {sys.executable} (the cluster at 127.0.0.1 is on this machine" in submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.startswith("tiny_cpu-") and "\n" not in job_id  # stdout is the job id alone
    assert client.get_job_info(job_id).entrypoint.startswith(f"{sys.executable} -m cluster.cli run")

    follow = subprocess.Popen([sys.executable, "-m", "cluster.cli", "logs", job_id, "--follow", "--address",
                               head.dashboard], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scraped: dict[float, float] = {}  # grpo_step -> grpo_reward_mean, as seen while the job runs
    deadline = time.monotonic() + 600
    while follow.poll() is None and time.monotonic() < deadline:
        try:
            samples = scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=2)
        except OSError:  # not serving yet, or already closed
            samples = {}
        step, reward = driver_value(samples, "grpo_step"), driver_value(samples, "grpo_reward_mean")
        if step is not None and reward is not None:
            scraped[step] = reward
        time.sleep(0.25)
    if follow.poll() is None:
        follow.kill()
    logs, err = follow.communicate(timeout=30)
    assert follow.returncode == 0, f"logs --follow: {err}\n{logs[-3000:]}"
    assert f"job {job_id} SUCCEEDED" in err
    assert f"step {steps} | v{steps}" in logs  # the driver's console line of the last step

    status = cli("status", job_id, "--address", head.dashboard)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout and "tiny_cpu" in status.stdout, status

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # Moving: the endpoint showed several steps while the job ran, each with that step's reward, and the reward
    # changed between them.
    assert len(scraped) >= 2, f"scraped only steps {sorted(scraped)}"
    assert all(s in range(1, steps + 1) for s in scraped), scraped
    for step, reward in scraped.items():
        assert reward == pytest.approx(records[int(step) - 1]["reward/mean"]), (step, reward)
    assert len(set(scraped.values())) >= 2, (scraped, [r["reward/mean"] for r in records])

    logs_again = cli("logs", job_id, "--address", head.dashboard)
    assert logs_again.returncode == 0 and f"step {steps} | v{steps}" in logs_again.stdout
    stopped = cli("stop", job_id, "--address", head.dashboard)
    assert stopped.returncode == 0 and "was not running" in stopped.stdout


def test_bad_spec_exits_2_and_submits_nothing(head, client, tmp_path):
    bad = tmp_path / "bad.yaml"
    text = EXAMPLE.read_text().replace("  replicas: 1\n", "  replicas: 0\n")
    assert text != EXAMPLE.read_text()
    bad.write_text(text)
    line = text.splitlines().index("  replicas: 0") + 1
    before = len(client.list_jobs())
    result = cli("submit", bad, "--address", head.dashboard)
    assert result.returncode == 2
    assert f"{bad}:{line}: rollout.replicas" in result.stderr and "nothing submitted" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(client.list_jobs()) == before


@pytest.mark.parametrize("command", [["status"], ["logs"], ["logs", "--follow"], ["stop"]])
def test_unknown_job_id_exits_2(head, command):
    result = cli(*command[:1], "no-such-job", *command[1:], "--address", head.dashboard)
    assert result.returncode == 2
    assert "no job 'no-such-job' on this cluster" in result.stderr and "Traceback" not in result.stderr


def test_scale_unknown_job_exits_2(head):
    result = cli("scale", "no-such-job", "--rollout-replicas", "2", "--address", head.dashboard)
    assert result.returncode == 2
    assert "no running grpo-cluster job 'no-such-job'" in result.stderr and "Traceback" not in result.stderr


def test_interpreter_without_the_project_fails_in_one_line(head, client, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    submitted = cli("submit", EXAMPLE, "--set", f"output_dir={tmp_path / 'out'}", "--python", python,
                    "--address", head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    details = jobs.wait_for_job(client, job_id, timeout_s=120)
    logs = client.get_job_logs(job_id)
    assert str(details.status) == "FAILED", logs
    assert "Traceback" not in logs, logs
    printed = logs.split("Running entrypoint for job", 1)[1].splitlines()[1:]  # after Ray's own preamble
    assert [line for line in printed if line.strip()] == [
        f"grpo-cluster: missing dependency: torch, transformers, ray, pydantic, yaml, safetensors, prometheus_client, "
        f"tqdm, filelock, psutil (interpreter {python}); submit with --python PATH (an interpreter on the cluster "
        f"that has the project's dependencies) or --pip REQUIREMENT"], logs
