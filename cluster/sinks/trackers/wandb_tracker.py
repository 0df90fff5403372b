"""wandb as a tracker (``metrics.trackers: [wandb]``): offline by default, files under ``output_dir/wandb``.

The run lands in ``output_dir/wandb/offline-run-*`` (offline unless ``metrics.wandb_mode`` or ``$WANDB_MODE``); the
configuration through ``wandb.init(config=)``; at the end the plot as a ``wandb.Image`` and each table as a
``wandb.Table`` in one row, and ``spec.yaml`` as a run file; each step's sample tables as ``wandb.Table`` s at the
step. Every key is plotted against a ``step`` metric
(``define_metric``), so steps logged again after a guard rollback are kept rather than refused for going backwards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.sinks.trackers.common import DEFAULT_PROJECT
from contract.trackers import Table

__all__ = ["WandbTracker"]


class WandbTracker:
    """wandb, offline by default (``metrics.wandb_mode``; ``$WANDB_MODE``); files under ``output_dir/wandb``."""

    name = "wandb"
    package = "wandb"
    install = "wandb (pip install -e '.[wandb]')"

    def __init__(self, spec, output_dir: Path):
        self.dir, self.run_name = output_dir, spec.name
        self.project = spec.metrics.project or DEFAULT_PROJECT
        self.mode = spec.metrics.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        self.run = None

    def location(self) -> str:
        if self.mode == "disabled":
            return "disabled ($WANDB_MODE): nothing written"
        return f"{self.mode}, {self.dir / 'wandb'}"

    def open(self, config: Mapping[str, Any]) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(project=self.project, name=self.run_name, dir=str(self.dir), mode=self.mode,
                              config=dict(config), settings=settings, reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, numbers: Mapping[str, float]) -> None:
        self.run.log({"step": step, **numbers})

    def log_table(self, step: int, table: Table) -> None:
        import wandb

        self.run.log({"step": step, table.name: wandb.Table(columns=list(table.columns), data=table.as_lists())})

    def artifacts(self, png: Path | None, tables: Sequence[Table], spec_yaml: Path | None) -> None:
        import wandb

        row: dict[str, Any] = {}
        if png is not None:
            row["plot"] = wandb.Image(str(png))
        for table in tables:
            if table.rows:
                row[table.name] = wandb.Table(columns=list(table.columns), data=table.as_lists())
        if row:
            self.run.log(row)
        if spec_yaml is not None:
            self.run.save(str(spec_yaml), base_path=str(spec_yaml.parent), policy="now")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
