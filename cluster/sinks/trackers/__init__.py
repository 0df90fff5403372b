"""Experiment trackers as metric sinks (``metrics.trackers``): wandb, MLflow, TensorBoard and trackio beside
``metrics.jsonl`` and Prometheus.

    metrics: {trackers: [wandb, mlflow, tensorboard, trackio]}      # in the job spec

:func:`build_trackers` gives the job one :class:`TrackerSink` per named tracker (``GRPOJob`` adds them to its default
sinks). The trackers themselves are :class:`contract.trackers.Tracker` implementations chosen by name from
:data:`cluster.sinks.trackers.registry.TRACKERS`, one module each (``wandb_tracker``, ``mlflow_tracker``,
``tensorboard_tracker``, ``trackio_tracker``). Every tracker receives:

- every step's driver row under the same keys as ``metrics.jsonl`` (numbers; bools as 0/1; non-finite values and
  non-numbers are left out of the tracker's row), at the job's step;
- the run configuration (:func:`run_config`): the whole spec, the git commit of the code and the package version;
- when the job closes, the ``grpo-cluster plot`` picture of ``metrics.jsonl`` and the held-out evaluation table (the
  ``eval/*`` columns of every evaluated step, :func:`eval_table`) as artifacts, in the tracker's own form;
- every step's samples (``metrics.samples_per_step``) as the tables ``samples/train`` and ``samples/eval``
  (``cluster.sinks.samples.samples_tables``) at their step, through the tracker's ``log_table``.

Per-worker figures (``workers.jsonl``) stay in Prometheus and the jsonl file. Each tracker writes under ``output_dir``
unless its own settings say otherwise (``metrics.wandb_mode: online``, ``metrics.mlflow_tracking_uri``,
``$TRACKIO_DIR``). A tracker that raises — no network, refused credentials, a full disk, a bug in the library — is
reported once on stderr and switched off for the rest of the job; training never stops for it. A tracker whose
library is missing is refused before the job starts (:class:`TrackerSetupError`, naming ``metrics.trackers``).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.sinks.metrics import MetricsError
from cluster.sinks.samples import samples_tables
from cluster.sinks.trackers.common import EVAL_COLUMNS, EVAL_TABLE
from cluster.sinks.trackers.registry import TRACKERS, register_tracker, tracker_class
from contract.trackers import Table, Tracker

__all__ = ["EVAL_COLUMNS", "TRACKERS", "TrackerSetupError", "TrackerSink", "build_trackers", "check_trackers",
           "eval_table", "register_tracker", "run_config", "tracker_class"]


class TrackerSetupError(MetricsError):
    """A tracker named in ``metrics.trackers`` cannot be used here (its library is not installed)."""


def check_trackers(trackers: list[str]) -> None:
    """Check that every tracker's library can be imported here (looked up, not imported; the tracker's own module is
    imported, which does not import its library).

    Raises:
        TrackerSetupError: naming ``metrics.trackers``, the tracker and what to install.
    """
    for name in trackers:
        tracker = tracker_class(name)
        if importlib.util.find_spec(tracker.package) is None:
            raise TrackerSetupError(f"metrics.trackers: {name!r} needs the {tracker.package} package, not installed "
                                    f"in {sys.executable}; install {tracker.install}, or remove {name!r} from the "
                                    f"list")


def git_commit(folder: Path | None = None) -> str | None:
    """The commit checked out in the git work tree holding ``folder`` (default: this package's), with ``-dirty``
    when tracked files differ from it; None outside a git work tree or without git."""
    where = folder or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha or None


def run_config(spec) -> dict[str, Any]:
    """The run configuration every tracker records: ``{"spec": <the spec as JSON data>, "git_commit": <sha or
    None>, "grpo_cluster_version": <package version or None>}``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("grpo-cluster")
    except PackageNotFoundError:
        package = None
    return {"spec": spec.model_dump(mode="json"), "git_commit": git_commit(), "grpo_cluster_version": package}


def eval_table(records: list[Mapping[str, Any]]) -> Table:
    """The held-out evaluation table ``eval/table``: one row per record with ``eval/accuracy`` (in step order; also
    one whose accuracy is null because nothing was scored, ``eval/unscored``), the values of :data:`EVAL_COLUMNS`
    (``step`` first; None where a column was not logged)."""
    rows = [r for r in records if "eval/accuracy" in r]
    return Table(EVAL_TABLE, EVAL_COLUMNS, [[r.get(column) for column in EVAL_COLUMNS]
                                            for r in sorted(rows, key=lambda r: r.get("step", 0))])


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (bools as 0/1, scalars with ``.item()`` unwrapped); others left out."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):
            try:
                value = value.item()
            except (TypeError, ValueError):
                continue
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[str(key)] = float(value)
    return out


class TrackerSink:
    """One tracker as a ``contract.protocols.MetricSink`` that never stops the job (module docstring).

    Args:
        backend: the tracker (:class:`contract.trackers.Tracker`), not yet opened. config: :func:`run_config`'s dict.
        output_dir: the job's folder (its ``metrics.jsonl`` is read for the artifacts at :meth:`close`).
        warn: where the one warning goes (default: a ``[grpo-cluster]`` line on stderr; the job passes its status
            line).

    Attributes:
        name: the tracker's name. failed: the first failure's message (None while the tracker works).
        log_seconds: wall seconds spent in the backend's ``log`` so far; logs: rows logged.
    """

    url = None  # no Prometheus endpoint

    def __init__(self, backend: Tracker, config: dict, output_dir: str | Path,
                 warn: Callable[[str], None] | None = None):
        self.backend, self.output_dir = backend, Path(output_dir)
        self.name = backend.name
        self._warn = warn or (lambda message: print(f"[grpo-cluster] {message}", file=sys.stderr, flush=True))
        self.failed: str | None = None
        self.log_seconds, self.logs = 0.0, 0
        self._closed = False
        self._guard("starting the run", backend.open, config)

    def _guard(self, what: str, call: Callable, *args) -> None:
        """Run ``call(*args)`` unless the tracker failed before; on an exception warn once and switch it off."""
        if self.failed is not None:
            return
        try:
            call(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of a tracker library must not stop training
            self.failed = f"{type(exc).__name__}: {exc}"
            self._warn(f"warning: tracker {self.name!r} failed {what} ({self.failed}); it is switched "
                       f"off for the rest of the job, training goes on (metrics.jsonl has every step)")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send the step's numbers to the tracker."""
        t0 = time.perf_counter()
        self._guard(f"logging step {step}", self.backend.log, int(step), _numbers(metrics))
        self.log_seconds += time.perf_counter() - t0
        self.logs += 1

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """The step's sample records as the tracker's tables (``cluster.sinks.samples.samples_tables``: one row per
        completion) at ``step``, through its ``log_table``; a tracker without one is passed over."""
        if not hasattr(self.backend, "log_table"):
            return
        t0 = time.perf_counter()
        for table in samples_tables(records):
            self._guard(f"logging the {table.name} table of step {step}", self.backend.log_table, int(step), table)
        self.log_seconds += time.perf_counter() - t0

    def log_worker(self, step: int, pool: str, worker: str, metrics: Mapping[str, Any]) -> None:
        """Per-worker figures are not sent to trackers (``workers.jsonl`` and Prometheus have them)."""

    def remove_worker(self, pool: str, worker: str) -> int:
        return 0

    def reopen(self) -> None:
        """Nothing to reopen: the tracker keeps the rows of steps a rollback undid (they are logged again)."""

    def close(self) -> None:
        """Log the plot picture and the evaluation table as artifacts, then finish the tracker's run (once)."""
        if self._closed:
            return
        self._closed = True
        self._guard("logging the plot and eval table", self._artifacts)
        self._guard("finishing the run", self.backend.close)

    def _artifacts(self) -> None:
        from cluster.sinks.metrics import read_metrics_jsonl
        from cluster.sinks.plot import PlotError, plot_run

        metrics = self.output_dir / "metrics.jsonl"
        records = read_metrics_jsonl(metrics) if metrics.is_file() else []
        try:
            png = plot_run(self.output_dir, self.output_dir / "plot.png") if records else None
        except PlotError:
            png = None  # nothing drawable (e.g. no step row yet)
        spec_yaml = self.output_dir / "spec.yaml"
        self.backend.artifacts(png, [eval_table(records)], spec_yaml if spec_yaml.is_file() else None)


def build_trackers(spec, output_dir: str | Path, warn: Callable[[str], None] | None = None) -> list[TrackerSink]:
    """One :class:`TrackerSink` per ``metrics.trackers`` entry, each started (its run opened, the config logged).

    Raises:
        TrackerSetupError: a tracker's library is not installed (:func:`check_trackers`).
    """
    check_trackers(list(spec.metrics.trackers))
    if not spec.metrics.trackers:
        return []
    config = run_config(spec)
    return [TrackerSink(tracker_class(name)(spec, Path(output_dir)), config, output_dir, warn)
            for name in spec.metrics.trackers]
