"""``grpo-cluster scale`` against a real Ray head (``ray start --head`` on 127.0.0.1). Run under the heavy-run lock:
``flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/ray/test_scale.py``.

- The control channel alone, with a stand-in driver (a Ray job that creates the control actor and records what it is
  asked): scale up, a request over the driver's bound, a spec change that cannot be applied live, scale down with a
  changed spec, a finished job (≈ 40 s).
- The real job: the tiny GRPO job goes from 1 to 2 rollout engines and back while it trains; both engines serve the
  current policy version; every prompt is trained exactly once (≈ 3 minutes). The driver writes one line per step
  to ``<output_dir>/trained_prompts.jsonl``: ``{"step", "policy_version", "prompts": [example indices], "engines"}``.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from tests.ray.test_submit import EXAMPLE, PARITY, cli

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


@pytest.fixture(scope="module")
def head(ray_head):
    return ray_head


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_scale_through_the_control_actor(head, client, tmp_path):
    from cluster.ops import jobs
    from cluster.spec import load_spec

    (tmp_path / "fake_driver.py").write_text(FAKE_DRIVER)
    spec = load_spec(EXAMPLE, ["ray.address=auto"])  # what `submit` would have recorded for examples/tiny_cpu.yaml
    job_id = client.submit_job(entrypoint="python fake_driver.py", runtime_env={"working_dir": str(tmp_path)},
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


def _trained_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_scale_rollout_mid_job(head, client, tiny_model_dir, gsm8k_train_path, tmp_path):
    from cluster.ops import jobs

    out, steps, prompts_per_step = tmp_path / "out", 60, 2  # tiny steps take ≈ 0.5–1 s
    submitted = cli("submit", EXAMPLE, "--set", f"model.path={tiny_model_dir}", "--set", f"output_dir={out}",
                    "--set", PARITY, "--set", "metrics.port=0", "--set", f"total_steps={steps}",
                    "--set", f"rollout.prompts_per_step={prompts_per_step}", "--import", "tests.parity_reward",
                    "--address", head.dashboard)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().splitlines()[-1]
    trained = out / "trained_prompts.jsonl"
    address = ["--address", head.dashboard]

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

    lines = _trained_lines(trained)
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
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for line in lines:
        record = records[line["step"]]
        assert line["policy_version"] == record["policy_version"] and line["engines"] == record["rollout/engines"]
        assert record["rollout/sample_policy_version_min"] == record["policy_version"] - 1, record
        assert record["rollout/staleness_max"] == 0, record
        assert record["sync/verified"] is True and record["rollout/logprob_diff"] < 2e-5, record
