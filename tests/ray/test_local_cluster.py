"""A job without an address starts its own Ray cluster, bound to 127.0.0.1, even while another cluster (a ``ray
start --head`` left running) is on the machine (issue 12: ``ValueError: When connecting to an existing cluster,
num_cpus and num_gpus must not be provided``). Starts Ray: run under the heavy-run lock. The issue's case end to end,
``grpo-cluster run`` beside such a head, is the job of tests/e2e/test_smollm2_slow.py (formerly
test_run_without_address_beside_a_running_head here, a tiny job of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_head import head_found_by_default as found_by_default

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import psutil, ray
from cluster.ray_shell.ray_init import init_ray
from cluster.spec import load_spec

if sys.argv[1] == "plain":  # what `run` and bench/step_budget did before
    try:
        ray.init(num_cpus=1, include_dashboard=False)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
else:
    init_ray(load_spec("tests/tiny_cpu.yaml", ["output_dir=/tmp/unused"]), None)
ours = {p.pid for p in psutil.Process().children(recursive=True)}
listen = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in ours}
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
                  "listen": sorted(listen)}))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def head_found_by_default():
    """A 1-CPU ``ray start --head`` that a plain ``ray.init()`` of the probes finds (their ``RAY_TMPDIR`` is the
    yielded folder; tests/ray_head.py)."""
    with found_by_default() as found:
        yield found


def probe(mode: str, ray_tmpdir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_plain_init_joins_the_running_head(head_found_by_default):
    """The setting reproduces the issue: without address="local", Ray joins the head and refuses num_cpus."""
    head, tmp = head_found_by_default
    assert "num_cpus and num_gpus must not be provided" in probe("plain", tmp)["error"]


def test_local_job_starts_its_own_cluster_on_loopback(head_found_by_default):
    head, tmp = head_found_by_default
    seen = probe("init_ray", tmp)
    host, port = seen["gcs"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) != head.gcs_port, seen  # its own GCS, not the head's
    assert seen["nodes"] == ["127.0.0.1"], seen
    assert seen["listen"] and set(seen["listen"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, seen


def test_validate_with_address_names_the_missing_resources(head_found_by_default, tiny_model_dir, tmp_path):
    """``validate --address`` joins the 1-CPU head and compares with what tiny_cpu.yaml reserves (2 CPUs)."""
    head, _ = head_found_by_default
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = ["validate", "tests/tiny_cpu.yaml", "--set", f"model.path={tiny_model_dir}", "--set",
            f"output_dir={tmp_path / 'out'}", "--address", f"127.0.0.1:{head.gcs_port}"]
    short = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert short.returncode == 2, short.stderr[-3000:]
    assert (f"the Ray cluster cannot hold this job: needs CPU 2 (rollout 1 x 1 + train 2 x 0.5), cluster has 1 "
            f"(set by rollout.num_cpus_per_replica, train.num_cpus_per_worker) (127.0.0.1:{head.gcs_port}, --address)"
            ) in short.stderr, short.stderr[-3000:]
    assert short.stdout == ""
    fits = subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--set", "train.world_size=1", "--set",
                           "rollout.num_cpus_per_replica=0.5"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert f"cluster:    127.0.0.1:{head.gcs_port} (--address); has CPU 1, GPU 0: enough" in fits.stdout
    assert not (tmp_path / "out").exists()
