"""``grpo-cluster submit / status / logs / scale / stop`` against a real Ray head (``ray start --head`` on 127.0.0.1).
Run under the heavy-run lock: ``flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/ray/test_submit.py``.

- One submitted tiny job (≈ 3 minutes): its logs are followed to SUCCEEDED and its Prometheus endpoint is scraped
  while it runs; it goes from 1 to 2 rollout engines and back while it trains (``grpo-cluster scale``); both engines
  serve the current policy version; every prompt is trained exactly once. The driver writes one line per step to
  ``<output_dir>/trained_prompts.jsonl``: ``{"step", "policy_version", "prompts": [example indices], "engines"}``.
  (Formerly test_submit_follow_and_scrape and test_scale.py's test_scale_rollout_mid_job, two jobs on two heads.)
- The control channel alone, with a stand-in driver (a Ray job that creates the control actor and records what it is
  asked): scale up, a request over the driver's bound, a spec change that cannot be applied live, scale down with a
  changed spec, a finished job (≈ 40 s).
- Issue #27 tried as a new user would: the own-task example (a jsonl with ``prompt`` + two extra columns, reward
  functions in a .py next to the spec) copied to a folder outside the project and submitted with ``grpo-cluster
  submit --follow``: the reward files travel with the job (they are not in the uploaded project folder), the job
  succeeds, and a recording reward shows every completion reached the rewards with its row's extra columns. It is
  submitted as the scaled job starts and runs beside it (formerly test_own_task_job.py, a job after it on a head of
  its own; the head has room for both: 3 CPUs at 2 engines + 2).
- A bad spec, unknown job ids and an interpreter without the project: exit 2 or one line, nothing submitted.

The head is started from the venv without activating it (``.venv/bin/ray start --head``: the ``python`` on the head's
PATH is not the venv's). Issue 12: the job died in a deep ``ModuleNotFoundError: torch``. Now ``--python`` defaults to
this interpreter for a cluster on this machine (the submitted tiny job shows it, and runs with it), and an interpreter
without the project fails in one line.

The random tiny model never solves GSM8K, so the job is scored by the test reward ``parity`` (tests/parity_reward.py,
imported by the job with ``--import``), which makes the reward series move.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cluster.ops import jobs
from tests.prometheus_scrape import scrape
from tests.ray_head import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "tiny_cpu.yaml"
PARITY = 'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}'
OWN_TASK = REPO / "examples" / "own_task"

SPY = '''
import json, os

def record(completions, answer, difficulty):
    """Weight 0: records the columns the job passed (one JSON line per call), scores nothing."""
    with open(os.environ["OWN_TASK_SPY"], "a") as fh:
        fh.write(json.dumps({"answer": answer, "difficulty": difficulty, "n": len(completions)}) + "\\n")
    return [0.0] * len(completions)
'''

FAKE_DRIVER = textwrap.dedent("""
    import time

    import ray

    from cluster.ray_shell.control import current_job_id, start_control

    ray.init(address="auto")
    control = start_control(current_job_id("fake"), 1)  # the Ray Jobs submission id (RAY_JOB_CONFIG_JSON_ENV_VAR)
    seen, deadline = [], time.monotonic() + 240
    while seen != [1, 2, 1] and time.monotonic() < deadline:
        n = control.desired_rollout_replicas()
        if not seen or seen[-1] != n:
            seen.append(n)
            print("DESIRED", n, flush=True)
        control.report({"step": len(seen), "policy_version": len(seen), "rollout_replicas": n,
                        "max_rollout_replicas": 2})
        time.sleep(0.2)
    control.close()
    assert seen == [1, 2, 1], seen
""")


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
    """A 6-CPU head whose PATH does not lead to this venv (``RayHead(venv_on_path=False)``): room for the scaled job
    at 2 engines (3 CPUs) and the own-task job (2) side by side."""
    from tests.ray_head import RayHead

    cluster = RayHead(num_cpus=6, venv_on_path=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(head):
    from cluster.ops.jobs import connect

    return connect(head.dashboard)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _trained_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def own_task_job(head, tiny_model_dir, tmp_path_factory):
    """The own-task job (module docstring) submitted with ``--follow`` by a process started here and not waited for:
    the scaled job's test uses this fixture so that both jobs run side by side, and
    :func:`test_own_task_submit_ships_the_reward_files_and_the_job_succeeds` waits for it. Yields ``process`` and
    ``folder`` (``stdout`` and ``stderr`` of the process, ``calls.jsonl`` of the recording reward, the job's ``out``);
    a process still running on leaving is killed (the head's end stops the job)."""
    base = tmp_path_factory.mktemp("own_task")
    task = base / "my_task"  # the user's folder: not inside the uploaded project
    task.mkdir()
    for name in ("train.jsonl", "test.jsonl", "reward.py", "spec.yaml"):
        shutil.copy2(OWN_TASK / name, task / name)
    (task / "spy.py").write_text(SPY)
    rewards = 'algorithm.rewards={"reward.py:correct": 1.0, "reward.py:within_budget": 0.2, "spy.py:record": 0.0}'
    overrides = [f"model.path={tiny_model_dir}", f"output_dir={base / 'out'}", "total_steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=8",
                 "train.num_threads=1", "eval.max_tokens=6", rewards]
    with open(base / "stdout", "w") as out, open(base / "stderr", "w") as err:  # files: no pipe fills up
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "submit", str(task / "spec.yaml"),
                                 *(x for o in overrides for x in ("--set", o)), "--env",
                                 f"OWN_TASK_SPY={base / 'calls.jsonl'}", "--address", head.dashboard, "--follow"],
                                cwd=REPO, stdout=out, stderr=err, text=True)
    try:
        yield {"process": proc, "folder": base}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.usefixtures("own_task_job")  # submitted first: it runs beside this job
def test_submitted_job_is_followed_scraped_and_scaled_1_2_1(head, client, tiny_model_dir, gsm8k_train_path,
                                                           tmp_path):
    out, port, steps, prompts_per_step = tmp_path / "out", free_port(), 40, 2  # tiny steps take ≈ 0.5–1 s
    submitted = cli("submit", EXAMPLE, "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}",
                    "--set", PARITY, "--set", f"metrics.port={port}", "--set", f"total_steps={steps}",
                    "--set", f"rollout.prompts_per_step={prompts_per_step}", "--import", "tests.parity_reward",
                    "--address", head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    assert "INFO" not in submitted.stderr, submitted.stderr  # Ray's upload chatter is silenced
    # The head's PATH has no python with the project: the default interpreter is this one (issue 12).
    assert f"--python {sys.executable} (the cluster at 127.0.0.1 is on this machine" in submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.startswith("tiny_cpu-") and "\n" not in job_id  # stdout is the job id alone
    assert client.get_job_info(job_id).entrypoint.startswith(f"{sys.executable} -m cluster.cli run")
    trained = out / "trained_prompts.jsonl"
    address = ["--address", head.dashboard]

    follow = subprocess.Popen([sys.executable, "-m", "cluster.cli", "logs", job_id, "--follow", *address], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scraped: dict[float, float] = {}  # grpo_step -> grpo_reward_mean, as seen while the job runs
    scraper = threading.Thread(target=scrape_while_running, args=(follow, port, scraped), daemon=True)
    scraper.start()
    try:
        def running() -> None:
            status = str(client.get_job_status(job_id))
            assert status not in jobs.TERMINAL, f"job {status} early:\n{client.get_job_logs(job_id)[-4000:]}"

        def lines_where(predicate):
            running()
            return [r for r in _trained_lines(trained) if predicate(r)]

        wait_until(lambda: lines_where(lambda r: True), 300, "the first trained step")
        up = cli("scale", job_id, "--rollout-replicas", "2", *address)
        assert up.returncode == 0 and "1 -> 2" in up.stdout, up.stderr
        first_two = wait_until(lambda: lines_where(lambda r: r["engines"] == 2), 300, "a step with 2 engines")[0]
        down = cli("scale", job_id, "--rollout-replicas", "1", *address)
        assert down.returncode == 0 and "2 -> 1" in down.stdout, down.stderr
        wait_until(lambda: lines_where(lambda r: r["engines"] == 1 and r["step"] > first_two["step"]), 300,
                   "a step with 1 engine again")
        final = jobs.wait_for_job(client, job_id, 600)
        assert str(final.status) == "SUCCEEDED", client.get_job_logs(job_id)[-4000:]
        logs, err = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
        scraper.join(30)
    assert follow.returncode == 0, f"logs --follow: {err}\n{logs[-3000:]}"
    assert f"job {job_id} SUCCEEDED" in err
    assert f"step {steps} | v{steps}" in logs  # the driver's console line of the last step

    status = cli("status", job_id, *address)
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
    logs_again = cli("logs", job_id, *address)
    assert logs_again.returncode == 0 and f"step {steps} | v{steps}" in logs_again.stdout
    stopped = cli("stop", job_id, *address)
    assert stopped.returncode == 0 and "was not running" in stopped.stdout
    _check_scaled_run(out, steps, prompts_per_step, records)


def test_own_task_submit_ships_the_reward_files_and_the_job_succeeds(own_task_job):
    base = own_task_job["folder"]
    returncode = own_task_job["process"].wait(timeout=900)
    stdout, stderr = (base / "stdout").read_text(), (base / "stderr").read_text()
    assert returncode == 0, f"{stderr[-3000:]}\n{stdout[-3000:]}"
    assert "SUCCEEDED" in stderr and "step 2 | v2" in stdout
    rows = {json.loads(line)["answer"]: json.loads(line)["difficulty"]
            for line in (OWN_TASK / "train.jsonl").read_text().splitlines()}
    recorded = [json.loads(line) for line in (base / "calls.jsonl").read_text().splitlines()]
    pairs = [(a, d) for call in recorded for a, d in zip(call["answer"], call["difficulty"])]
    assert len(pairs) == 2 * 2 * 4  # every completion of both steps
    assert all(rows[a] == d for a, d in pairs)  # each with its own row's extra columns
    metrics = [json.loads(line) for line in (base / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/reward.py:correct" in m for m in metrics)


def scrape_while_running(follow: subprocess.Popen, port: int, scraped: dict, timeout_s: float = 900) -> None:
    """Until ``follow`` (``logs --follow``) ends: scrape the job's endpoint every 0.25 s into ``scraped``
    (``grpo_step`` → ``grpo_reward_mean`` of the driver)."""
    deadline = time.monotonic() + timeout_s
    while follow.poll() is None and time.monotonic() < deadline:
        try:
            samples = scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=2)
        except OSError:  # not serving yet, or already closed
            samples = {}
        step, reward = driver_value(samples, "grpo_step"), driver_value(samples, "grpo_reward_mean")
        if step is not None and reward is not None:
            scraped[step] = reward
        time.sleep(0.25)


def _check_scaled_run(out: Path, steps: int, prompts_per_step: int, records: list[dict]) -> None:
    """The scaled job's audit: 1 engine, then 2, then 1; every prompt once; both engines served the current policy."""
    lines = _trained_lines(out / "trained_prompts.jsonl")
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    engines = [r["engines"] for r in lines]
    assert engines[0] == 1 and 2 in engines and engines[-1] == 1, engines
    # No prompt lost or duplicated: every step trained B prompts, each drawn once (steps · B < one GSM8K epoch).
    prompts = [p for r in lines for p in r["prompts"]]
    assert all(len(r["prompts"]) == prompts_per_step for r in lines), [len(r["prompts"]) for r in lines]
    assert len(set(prompts)) == len(prompts) == steps * prompts_per_step
    # Both engines serve: in every 2-engine step each engine sampled at least one of the step's groups and produced
    # tokens (workers.jsonl: one row per engine and step; queue_depth = groups dispatched to it that step), and a
    # 1-engine step has one row. Both serve the current policy: every group of a step was sampled by the policy of
    # the step before (staleness 0), with logprobs matching the trainer's (an engine left on older weights would
    # differ by ~1e-3), and every sync was verified.
    workers: dict[int, dict[str, dict]] = {}
    for row in map(json.loads, (out / "workers.jsonl").read_text().splitlines()):
        if row["pool"] == "rollout":
            workers.setdefault(row["step"], {})[row["worker"]] = row
    for line in lines:
        rows = workers[line["step"]]
        assert sorted(rows) == [f"engine-{i}" for i in range(line["engines"])], (line, rows)
        assert sum(r["rollout/queue_depth"] for r in rows.values()) >= prompts_per_step, rows
        assert all(r["rollout/queue_depth"] >= 1 and r["perf/rollout_tokens_per_s"] > 0 for r in rows.values()), rows
    by_step = {r["step"]: r for r in records}
    for line in lines:
        record = by_step[line["step"]]
        assert line["policy_version"] == record["policy_version"] and line["engines"] == record["rollout/engines"]
        assert record["rollout/sample_policy_version_min"] == record["policy_version"] - 1, record
        assert record["rollout/staleness_max"] == 0, record
        assert record["sync/verified"] is True and record["rollout/logprob_diff"] < 2e-5, record


def test_scale_through_the_control_actor(head, client, tmp_path):
    """The stand-in driver runs with this interpreter (the head's PATH has no python with the project)."""
    from cluster.ops import jobs
    from cluster.spec import load_spec

    (tmp_path / "fake_driver.py").write_text(FAKE_DRIVER)
    spec = load_spec(EXAMPLE, ["ray.address=auto"])  # what `submit` would have recorded for tests/tiny_cpu.yaml
    job_id = client.submit_job(entrypoint=f"{sys.executable} fake_driver.py",
                               runtime_env={"working_dir": str(tmp_path)},
                               metadata={jobs.METADATA_SPEC: spec.model_dump_json()})
    wait_until(lambda: "DESIRED 1" in client.get_job_logs(job_id), 120, "the stand-in driver to start")
    address = ["--address", head.dashboard]

    up = cli("scale", job_id, "--rollout-replicas", "2", *address)
    assert up.returncode == 0, up.stderr
    assert "INFO" not in up.stderr, up.stderr  # Ray's upload chatter is silenced
    assert "rollout replicas 1 -> 2 requested" in up.stdout and "1 engine(s) serving" in up.stdout
    wait_until(lambda: "DESIRED 2" in client.get_job_logs(job_id), 30, "the driver to see 2")

    over = cli("scale", job_id, "--rollout-replicas", "3", *address)
    assert over.returncode == 2 and "expected an integer in [1, 2], got 3" in over.stderr, over.stderr

    changed = tmp_path / "changed.yaml"  # elsewhere than the example: its data paths made absolute, as submit has them
    shared = os.path.normpath(EXAMPLE.parent / "../../shared")
    changed.write_text(EXAMPLE.read_text().replace("../../shared", shared).replace("lr: 1.0e-5", "lr: 3.0e-5").replace(
        "max_response_tokens: 16", "max_response_tokens: 32"))
    fixed = cli("scale", job_id, changed, *address)
    assert fixed.returncode == 2
    assert "cannot be applied to a running job: rollout.max_response_tokens, train.lr" in fixed.stderr

    down = cli("scale", job_id, EXAMPLE, *address)  # rollout.replicas: 1 in the example
    assert down.returncode == 0, down.stderr
    assert "rollout replicas 2 -> 1 requested" in down.stdout
    assert str(jobs.wait_for_job(client, job_id, 60).status) == "SUCCEEDED", client.get_job_logs(job_id)

    ended = cli("scale", job_id, "--rollout-replicas", "2", *address)
    assert ended.returncode == 2 and "is SUCCEEDED: nothing to scale" in ended.stderr


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
