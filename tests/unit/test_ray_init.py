"""Which cluster a job runs on (cluster/ray_shell/ray_init.py) and the driver's dependency check
(cluster/ops/prepare.py), without starting Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ops import prepare
from cluster.ray_shell.control import JOB_ID_ENV
from cluster.ray_shell.ray_init import AddressError, job_address
from cluster.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "tiny_cpu.yaml"


@pytest.fixture
def spec(tmp_path):
    return load_spec(EXAMPLE, [f"output_dir={tmp_path}"])


def test_no_address_anywhere_means_a_local_cluster(spec, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_address(None, spec) == (None, "local")


def test_ray_address_env_is_joined_and_named(spec, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert job_address(None, spec) == ("auto", "$RAY_ADDRESS")
    assert job_address("ray://h:10001", spec) == ("ray://h:10001", "--address")  # --address first
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(AddressError, match=r"cannot reach a Ray cluster at 127\.0\.0\.1:1 \(\$RAY_ADDRESS\)"):
        job_address(None, spec)


def test_a_jobs_api_url_is_refused_with_the_submit_command(spec, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(AddressError, match=r"\(\$RAY_ADDRESS\) is a Ray Jobs API .* `grpo-cluster submit SPEC"):
        job_address(None, spec)


def test_missing_dependency_is_one_line_naming_interpreter_and_fix(monkeypatch):
    monkeypatch.setattr(prepare, "DRIVER_MODULES", ("json", "no_such_module_h5", "torch"))
    monkeypatch.delenv(JOB_ID_ENV, raising=False)
    line = prepare.missing_dependency()
    assert line == (f"missing dependency: no_such_module_h5 (interpreter {sys.executable}); install the project's "
                    f"dependencies (scripts/setup.sh) or use the interpreter that has them")
    monkeypatch.setenv(JOB_ID_ENV, "job-1")
    assert prepare.missing_dependency().endswith("submit with --python PATH (an interpreter on the cluster that has "
                                                 "the project's dependencies) or --pip REQUIREMENT")
    monkeypatch.setattr(prepare, "DRIVER_MODULES", ("json",))
    assert prepare.missing_dependency() is None


def test_run_with_an_interpreter_without_the_project_exits_2_in_one_line(tmp_path):
    """A bare virtualenv (no torch, no pydantic, no ray) runs ``grpo-cluster run`` as a submitted job would."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    result = subprocess.run([str(python), "-m", "cluster.cli", "run", str(EXAMPLE)], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin", JOB_ID_ENV: "job-1"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"grpo-cluster: missing dependency: torch, transformers, ray, pydantic, yaml, safetensors, prometheus_client, "
        f"tqdm, filelock, psutil (interpreter {python}); submit with --python PATH (an interpreter on the cluster "
        f"that has the project's dependencies) or --pip REQUIREMENT"], result.stderr


def test_submit_default_interpreter(monkeypatch):
    """A cluster on this machine runs the job with this interpreter; another machine with its ``python``."""
    from cluster.ops.jobs import default_python

    for local in ("http://127.0.0.1:8265", "localhost:8265", "http://[::1]:8265"):
        assert default_python(local)[0] == sys.executable, local
    import psutil

    mine = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family.name == "AF_INET" and not a.address.startswith("127.")), None)
    if mine is not None:  # a machine with a routable IPv4 address: that address is this machine too
        assert default_python(f"http://{mine}:8265")[0] == sys.executable
    python, why = default_python("http://203.0.113.7:8265")  # TEST-NET-3: never this machine
    assert python == "python" and "another machine" in why
