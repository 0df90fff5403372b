"""A real Prometheus server for tests: Debian's ``prometheus`` binary (the package that also ships ``promtool``;
``scripts/install_test_tools.sh`` installs it), started on loopback with a config the test writes, stopped by its pid,
and queried through its HTTP API (``/api/v1/query``, ``/api/v1/query_range``, ``/api/v1/alerts``,
``/api/v1/rules``, ``/api/v1/label/<name>/values``).

    with PrometheusServer.started(tmp, config, rule_files={"alerts.yml": text}, port=free_port()) as prom:
        prom.query("up")          # [{"metric": {...}, "value": [t, "1"]}, ...]

Tests that need it skip when the binary is missing: :func:`missing_reason`.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

BINARY = "prometheus"
READY_TIMEOUT_S = 30.0


class PrometheusError(RuntimeError):
    """The server did not start, or a query failed (the message holds Prometheus's own error or log)."""


def missing_reason(path: str | None = None) -> str | None:
    """Why no real Prometheus can run here (the skip reason), or None when ``prometheus`` is on ``path``
    (default ``$PATH``)."""
    if shutil.which(BINARY, path=path) is None:
        return ("the prometheus binary is not on PATH (Debian package `prometheus`, which also ships promtool; "
                "scripts/install_test_tools.sh installs it)")
    return None


class PrometheusServer:
    """One ``prometheus`` process on ``127.0.0.1:port`` with its config and rule files in ``folder``.

    Attributes:
        url: ``http://127.0.0.1:<port>``. process: the ``subprocess.Popen``. log: the server's stdout/stderr file.
    """

    def __init__(self, folder: Path, port: int, process: subprocess.Popen, log: Path):
        self.folder = folder
        self.port = port
        self.process = process
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    @contextmanager
    def started(cls, folder: Path, config: dict, rule_files: dict[str, str], port: int) -> Iterator[PrometheusServer]:
        """Write ``config`` (``rule_files`` added by name) and the rule files into ``folder``, start the server with
        its TSDB there, wait until it answers a query, yield it; kill it by its pid on leaving.

        Raises:
            PrometheusError: the process exited or did not answer within :data:`READY_TIMEOUT_S` (its log's tail).
        """
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in rule_files.items():
            (folder / name).write_text(text)
        (folder / "prometheus.yml").write_text(yaml.safe_dump({**config, "rule_files": list(rule_files)}))
        log = folder / "prometheus.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                [BINARY, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
        server = cls(folder, port, process, log)
        try:
            server._wait_ready()
            yield server
        finally:
            server.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.process.returncode}: {self.log_tail()}")
            try:
                self.query("up")
                return
            except (PrometheusError, OSError):
                if time.monotonic() > deadline:
                    raise PrometheusError(f"prometheus did not answer on {self.url} within {READY_TIMEOUT_S:.0f} "
                                          f"s: {self.log_tail()}") from None
                time.sleep(0.2)

    def wait_for_targets(self, count: int, timeout_s: float = 20.0) -> None:
        """Wait until ``count`` scrape targets have been tried (an ``up`` series each, 0 while nothing listens):
        Prometheus hands discovered targets to its scrapers at most every 5 s, so the first scrape comes seconds
        after the start.

        Raises:
            PrometheusError: fewer targets after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while len(self.query("up")) < count:
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus scraped {len(self.query('up'))} of {count} targets within "
                                      f"{timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 8) -> str:
        """The last ``lines`` lines of the server's log."""
        return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the process by its pid (kill after 10 s); safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    # ---- the HTTP API ---------------------------------------------------------------------------------------------
    def _get(self, path: str, **params) -> object:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus's error in the JSON body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query (``/api/v1/query``) at Unix time ``at`` (default now): the result's vector (a scalar
        result is returned as one sample without labels)."""
        data = self._get("/api/v1/query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """Range query (``/api/v1/query_range``), Grafana's way of drawing a panel: ``[{"metric", "values":
        [[t, "v"], ...]}, ...]``, one entry per series with at least one point. The points end at ``end`` exactly (the
        window's start moved back to a whole number of steps before it): a run shorter than a step still has its last
        scrape in range."""
        start = end - math.ceil(max(end - start, 0.0) / step_s) * step_s
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}s")
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """Values of ``label`` on the series ``match`` selects (Grafana's ``label_values(match, label)``)."""
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def alerts(self) -> list[dict]:
        """Active alerts of the rule manager (``/api/v1/alerts``): each with ``labels``, ``state`` (pending or
        firing), ``activeAt``."""
        return self._get("/api/v1/alerts")["alerts"]

    def rules(self) -> list[dict]:
        """Every loaded rule (``/api/v1/rules``), flattened over groups: ``name``, ``query``, ``type``, ``health``,
        ``lastError``."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]
