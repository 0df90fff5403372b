"""Job submission and control plumbing without a cluster: the control actor's state, job ids, what a submission
uploads, which spec changes can be applied live, and the CLI's exit codes before anything reaches Ray."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from cluster import cli
from cluster.ops import jobs, upload
from cluster.ray_shell import control
from cluster.spec import RolloutSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "tiny_cpu.yaml"


def test_control_state_scale_requests_and_reports():
    state = control.JobControlState("job-1", 1)
    assert state.desired_rollout_replicas() == 1 and state.summary()["status"] == {}
    answer = state.set_desired_rollout_replicas(2)
    assert answer["previous_desired"] == 1 and answer["desired_rollout_replicas"] == 2
    assert state.desired_rollout_replicas() == 2
    state.report({"step": 3, "policy_version": 3, "rollout_replicas": 1, "max_rollout_replicas": 2})
    assert state.summary()["status"]["rollout_replicas"] == 1 and state.summary()["reported_s_ago"] >= 0
    with pytest.raises(ValueError, match=r"expected an integer in \[1, 2\], got 3"):
        state.set_desired_rollout_replicas(3)  # above the driver's reported bound
    assert state.desired_rollout_replicas() == 2  # a refused request changes nothing
    json.dumps(state.summary())


@pytest.mark.parametrize("bad", [0, -1, control.MAX_ROLLOUT_REPLICAS + 1, True, 1.0, "2", None])
def test_check_replicas_rejects(bad):
    with pytest.raises(ValueError, match="rollout replicas: expected an integer in"):
        control.check_replicas(bad)


def test_replica_bound_matches_the_spec():
    bounds = [m.le for m in RolloutSpec.model_fields["replicas"].metadata if hasattr(m, "le")]
    assert bounds == [control.MAX_ROLLOUT_REPLICAS]


def test_current_job_id_precedence(monkeypatch):
    monkeypatch.delenv(control.JOB_ID_ENV, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert control.current_job_id("tiny_cpu") == "tiny_cpu"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_x"}}))
    assert control.current_job_id("tiny_cpu") == "raysubmit_x"
    monkeypatch.setenv(control.JOB_ID_ENV, "tiny_cpu-0a1b2c3d")
    assert control.current_job_id("tiny_cpu") == "tiny_cpu-0a1b2c3d"
    assert control.actor_name("tiny_cpu-0a1b2c3d") == "grpo-cluster-control:tiny_cpu-0a1b2c3d"


def test_control_entrypoint_rejects_bad_arguments_before_joining_a_cluster(capsys):
    assert control._main(["set", "job"]) == 2
    assert control._main(["set", "job", "0"]) == 2
    assert control._main(["set", "job", "two"]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith(control.ERROR_MARKER) for line in lines)
    assert "got 0" in lines[1] and "got 'two'" in lines[2]


def test_control_module_imports_only_stdlib_and_ray():
    """``scale`` ships cluster/ray_shell/control.py alone as its control job's working dir."""
    import ast

    tree = ast.parse((REPO / "cluster" / "ray_shell" / "control.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert names <= {"__future__", "json", "logging", "os", "sys", "time", "typing", "ray"}, names


def test_stage_working_dir_excludes_venv_git_outputs_and_caches(tmp_path):
    root = tmp_path / "proj"
    for rel in ["cluster/cli.py", "README.md", ".venv/bin/python", ".git/HEAD", "runs/x/metrics.jsonl",
                "outputs/a.txt", "cluster/__pycache__/cli.cpython-311.pyc", "grpo_cluster.egg-info/PKG-INFO",
                ".pytest_cache/v", "tests/deep/__pycache__/t.pyc"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    dest = jobs.stage_working_dir(root, tmp_path / "stage", {jobs.SPEC_FILE: "name: t\n"})
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == ["README.md", "cluster/cli.py", jobs.SPEC_FILE]


def test_stage_working_dir_refuses_a_big_upload(tmp_path, monkeypatch):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "weights.bin").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(upload, "MAX_UPLOAD_BYTES", 1024)
    with pytest.raises(jobs.JobsError, match=r"largest files: weights\.bin"):
        jobs.stage_working_dir(tmp_path / "proj", tmp_path / "stage")


def test_project_upload_is_small(tmp_path):
    dest = jobs.stage_working_dir(jobs.project_root(), tmp_path / "stage")
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    assert (dest / "cluster" / "cli.py").is_file() and not (dest / ".venv").exists() and not (dest / ".git").exists()
    assert total < 10 * 2**20, total


def test_live_spec_changes_allow_only_rollout_replicas():
    base = load_spec(EXAMPLE, ["ray.address=auto"])
    assert jobs.live_spec_changes(base, base) == ([], [])
    more = load_spec(EXAMPLE, ["ray.address=auto", "rollout.replicas=3", "ray.num_cpus=1"])
    assert jobs.live_spec_changes(base, more) == (["rollout.replicas"], [])  # the ray section is ignored
    assert jobs.live_spec_changes(base.model_dump(mode="json"), more) == (["rollout.replicas"], [])  # as submitted
    other = load_spec(EXAMPLE, ["ray.address=auto", "rollout.replicas=2", "train.lr=0.001",
                                "algorithm.rewards={accuracy: 1.0}"])
    assert jobs.live_spec_changes(base, other) == (
        ["rollout.replicas"], ["algorithm.rewards.format", "train.lr"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submit_bad_spec_exits_2_before_connecting(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jobs, "connect", lambda *a, **k: pytest.fail("connected despite a bad spec"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("  group_size: 4\n", "  group_size: 1\n"))
    assert cli.main(["submit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nothing submitted" in err and f"{bad}:" in err and "rollout.group_size" in err


@pytest.mark.parametrize("argv", [["status", "j"], ["logs", "j"], ["logs", "j", "--follow"], ["stop", "j"],
                                  ["scale", "j", "--rollout-replicas", "2"], ["submit", str(EXAMPLE)]])
def test_unreachable_address_exits_2(argv, capsys):
    address = f"http://127.0.0.1:{_closed_port()}"
    assert cli.main([*argv, "--address", address]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Ray dashboard at {address}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["scale", "j"], "give exactly one of --rollout-replicas N or a changed SPEC.yaml"),
    (["scale", "j", str(EXAMPLE), "--rollout-replicas", "2"], "give exactly one of"),
    (["scale", "j", "--rollout-replicas", "0"], "--rollout-replicas: expected a whole number >= 1, got 0"),
    (["scale", "j", "--rollout-replicas", "5000"], "expected an integer in [1, 4096], got 5000"),
    (["scale", "j", "--rollout-replicas", "2", "--set", "train.lr=1"], "--set applies to SPEC.yaml"),
    (["submit", str(EXAMPLE), "--env", "NOVALUE"], "--env 'NOVALUE': expected KEY=VALUE"),
    (["submit", str(EXAMPLE), "--import", "no_such_module_xyz"], "--import no_such_module_xyz"),
    (["run", str(EXAMPLE), "--import", "no_such_module_xyz"], "--import no_such_module_xyz"),
])
def test_argument_errors_exit_2(argv, message, capsys):
    assert cli.main([*argv, "--address", f"http://127.0.0.1:{_closed_port()}"]) == 2
    assert message in capsys.readouterr().err


def test_default_address(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert jobs.default_address() == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert jobs.default_address() == "http://head:8265"
