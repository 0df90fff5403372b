"""A throwaway Ray head for tests: ``ray start --head`` on 127.0.0.1 with its own temp dir and free ports, stopped
by killing only its own processes (``ray stop`` would stop every Ray cluster on the machine); and such a head that a
plain ``ray.init()`` finds (:func:`head_found_by_default`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

from cluster.ops.prestop import wait_gone


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1: all sockets stay bound until every port is chosen (ports picked one at
    a time can repeat, and Ray refuses two components on one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RayHead:
    """Start a single-node Ray cluster; ``dashboard`` is its Jobs API address (``http://127.0.0.1:PORT``).

    Args:
        num_cpus: logical CPUs the node advertises.
        object_store_bytes: plasma store size (kept small: the machine is shared).

        venv_on_path: True puts this interpreter's folder first on the cluster's PATH, so job entrypoints ``python -m
            ...`` run in the same environment as the tests; False takes that folder off PATH, as for a head started
            as ``.venv/bin/ray start --head`` without activating the venv.
    """

    def __init__(self, num_cpus: int = 4, object_store_bytes: int = 200_000_000, venv_on_path: bool = True):
        self.temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
        names = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")
        self.gcs_port, self.dashboard_port, *others = free_ports(2 + len(names))
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        bin_dir = str(Path(sys.executable).parent)
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
        self.env = {**os.environ, "PATH": os.pathsep.join([bin_dir, *path] if venv_on_path else path),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        ray_bin = str(Path(sys.executable).parent / "ray")
        ports = {f"--{name}": str(port) for name, port in zip(names, others)}
        cmd = [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
               "--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_bytes),
               "--temp-dir", self.temp_dir, "--disable-usage-stats", "--include-dashboard", "true",
               *(x for kv in ports.items() for x in kv)]
        result = subprocess.run(cmd, check=False, env=self.env, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        self._wait_for_jobs_api(timeout_s=60)

    def _wait_for_jobs_api(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=5):
                    return
            except urllib.error.HTTPError:  # 401 with Ray's token auth (on by default): the server answers
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: those whose command line names its temp dir, and all their descendants."""
        roots = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp_dir in part for part in proc.info["cmdline"] or ()):
                    roots.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        found = {p.pid: p for p in roots}
        for proc in roots:
            try:
                found.update({c.pid: c for c in proc.children(recursive=True)})
            except psutil.NoSuchProcess:
                continue
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM this cluster's processes, SIGKILL what is left after ``grace_s``, remove the temp dir. A process
        that has exited counts as stopped even while it is a zombie (its parent has not collected it: in a container
        whose PID 1 collects nothing, the children of the head's exited processes stay zombies, and waiting for them
        to disappear would wait out ``grace_s`` twice)."""
        procs = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            procs = wait_gone(procs, grace_s, poll_s=0.1)
            if not procs:
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextmanager
def head_found_by_default(num_cpus: int = 1) -> Iterator[tuple[RayHead, str]]:
    """A :class:`RayHead` that a plain ``ray.init()`` (no address) finds in a process whose ``RAY_TMPDIR`` is the
    yielded folder: the head's temp dir is linked as ``<folder>/ray``, Ray's default place for the
    ``ray_current_cluster`` file, so no other process on the machine sees it (issue 12's setting: a ``ray start
    --head`` left running). Yields (head, folder); stops the head and removes the folder on leaving."""
    head = RayHead(num_cpus=num_cpus)
    tmp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths must stay < 108 characters
    os.symlink(head.temp_dir, os.path.join(tmp, "ray"))
    try:
        yield head, tmp
    finally:
        head.stop()
        os.unlink(os.path.join(tmp, "ray"))
        os.rmdir(tmp)
