"""MLflow as a tracker (``metrics.trackers: [mlflow]``), through ``MlflowClient`` (no global active run).

The store is ``metrics.mlflow_tracking_uri``, ``$MLFLOW_TRACKING_URI``, or an SQLite store
``output_dir/mlflow/mlflow.db`` with artifacts in ``output_dir/mlflow/artifacts``; the experiment is
``metrics.project``. The configuration is logged as params with dotted keys and the commit as a tag; at the end the
artifacts ``plot.png``, each table as ``<name with _>.json`` (``eval_table.json``, ``mlflow.log_table``'s layout, so
the UI shows it as a table) and ``spec.yaml``; the sample tables through ``log_table``
(``samples_train/steps_000000-000099.json``, ...), appended every :data:`TABLE_FLUSH_STEPS` steps and at the end, in
files of :data:`TABLE_PART_STEPS` steps, the first :data:`MAX_TABLE_FILES` of them (:meth:`MlflowTracker.log_table`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.sinks.trackers.common import DEFAULT_PROJECT, flatten
from contract.trackers import Table

__all__ = ["MAX_TABLE_FILES", "TABLE_FLUSH_STEPS", "TABLE_PART_STEPS", "MlflowTracker"]

#: Steps whose sample tables share one MLflow table file: ``log_table`` appends to a file by reading and writing it
#: whole, so a part bounds that cost.
TABLE_PART_STEPS = 100
#: Steps of sample-table rows kept before they are appended (one ``log_table`` call, ≈ 0.1-0.3 s, per table per this
#: many steps; the rest at the end of the job).
TABLE_FLUSH_STEPS = 10
#: Table files a run gets: MLflow lists a run's tables in one tag of at most 8,000 characters (≈ 68 per file), so the
#: sample tables stop after 50 files — 2,500 steps of ``samples/train`` and ``samples/eval`` — and samples.jsonl
#: keeps the rest.
MAX_TABLE_FILES = 50


class MlflowTracker:
    """MLflow through ``MlflowClient``: ``metrics.mlflow_tracking_uri``, ``$MLFLOW_TRACKING_URI``, or an SQLite store in
    ``output_dir/mlflow``; experiment ``metrics.project``."""

    name = "mlflow"
    package = "mlflow"
    install = "mlflow-skinny with sqlalchemy and alembic (pip install -e '.[mlflow]')"

    def __init__(self, spec, output_dir: Path):
        self.experiment, self.run_name = spec.metrics.project or DEFAULT_PROJECT, spec.name
        self.uri = spec.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.folder = None if self.uri else (output_dir / "mlflow").resolve()
        if self.folder is not None:
            self.uri = f"sqlite:///{self.folder / 'mlflow.db'}"
        self.client = self.run_id = None
        self._pending: dict[str, tuple[list[str], list[list]]] = {}  # table file → (columns, rows not yet logged)
        self._tables: set[str] = set()  # table files logged (or pending)

    def location(self) -> str:
        """The tracking URI, its password (if any) replaced by ``***``."""
        parts = urlsplit(self.uri)
        return self.uri if parts.password is None else self.uri.replace(f":{parts.password}@", ":***@", 1)

    def open(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        artifacts = None
        if self.folder is not None:
            (self.folder / "artifacts").mkdir(parents=True, exist_ok=True)
            artifacts = (self.folder / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(
            self.experiment, artifact_location=artifacts)
        commit = config.get("git_commit") or ""
        run = self.client.create_run(experiment_id, run_name=self.run_name,
                                     tags={"mlflow.source.git.commit": commit, "git_commit": commit})
        self.run_id = run.info.run_id
        params = [Param(key, value[:6000]) for key, value in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, numbers: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numbers.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, step: int, table: Table) -> None:
        """Keep the rows; every :data:`TABLE_FLUSH_STEPS` steps (and at :meth:`close`) append them with
        ``MlflowClient.log_table`` to ``<name with _>/steps_<first>-<last>.json``, one file per
        :data:`TABLE_PART_STEPS` steps, for the first :data:`MAX_TABLE_FILES` files (module docstring)."""
        first = step // TABLE_PART_STEPS * TABLE_PART_STEPS
        part = f"{table.file_stem}/steps_{first:06d}-{first + TABLE_PART_STEPS - 1:06d}.json"
        for done in [p for p in self._pending if p.startswith(f"{table.file_stem}/") and p != part]:
            self._flush(done)  # the table's earlier part is complete
        if part not in self._tables and len(self._tables) >= MAX_TABLE_FILES:
            return
        self._tables.add(part)
        self._pending.setdefault(part, (list(table.columns), []))[1].extend(table.as_lists())
        if step % TABLE_FLUSH_STEPS == 0:
            self._flush(part)

    def _flush(self, part: str) -> None:
        columns, rows = self._pending.pop(part)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # an append downloads the file: no bar
        self.client.log_table(self.run_id, data={name: [row[j] for row in rows] for j, name in enumerate(columns)},
                              artifact_file=part)

    def artifacts(self, png: Path | None, tables: Sequence[Table], spec_yaml: Path | None) -> None:
        for path in (png, spec_yaml):
            if path is not None:
                self.client.log_artifact(self.run_id, str(path))
        for table in tables:
            if table.rows:  # the layout mlflow.log_table writes, so the UI shows it as a table
                self.client.log_dict(self.run_id, {"columns": list(table.columns), "data": table.as_lists()},
                                     f"{table.file_stem}.json")

    def close(self) -> None:
        if self.run_id is not None:
            for part in list(self._pending):
                self._flush(part)
            self.client.set_terminated(self.run_id)
