"""trackio as a tracker (``metrics.trackers: [trackio]``): its local SQLite database ``<project>.db``.

The database is in ``$TRACKIO_DIR`` when set, else ``output_dir/trackio`` (trackio reads the folder when it is first
imported, so a process that imported it earlier keeps its folder: :attr:`TrackioTracker.folder`); the
configuration through ``trackio.init(config=)``; at the end artifacts for the plot, each table
(``<run>_<name with _>.json``, the ``eval_table`` one) and ``spec.yaml``; each step's sample tables as
``trackio.Table`` s at the step.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.sinks.trackers.common import DEFAULT_PROJECT
from contract.trackers import Table

__all__ = ["TrackioTracker"]


class TrackioTracker:
    """trackio's local SQLite database: ``$TRACKIO_DIR`` when set, else ``output_dir/trackio`` (module docstring)."""

    name = "trackio"
    package = "trackio"
    install = "trackio (pip install -e '.[trackio]')"

    def __init__(self, spec, output_dir: Path):
        self.project, self.run_name = spec.metrics.project or DEFAULT_PROJECT, spec.name
        self.wanted = Path(os.environ.get("TRACKIO_DIR") or output_dir / "trackio")
        self.folder: Path | None = None  # where trackio writes, known once it is imported
        self.run = None

    def location(self) -> str:
        return str(self.wanted.resolve())

    def open(self, config: Mapping[str, Any]) -> None:
        if not os.environ.get("TRACKIO_DIR"):  # unset or empty: trackio would take $HF_HOME/trackio
            os.environ["TRACKIO_DIR"] = str(self.wanted)
        import trackio
        from trackio import utils

        self.folder = Path(utils.TRACKIO_DIR)
        self.folder.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):  # trackio prints a banner
            self.run = trackio.init(project=self.project, name=self.run_name, config=dict(config), embed=False,
                                    auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, numbers: Mapping[str, float]) -> None:
        self.run.log(dict(numbers), step=step)

    def log_table(self, step: int, table: Table) -> None:
        import trackio

        self.run.log({table.name: trackio.Table(columns=list(table.columns), data=table.as_lists())}, step=step)

    def artifacts(self, png: Path | None, tables: Sequence[Table], spec_yaml: Path | None) -> None:
        files = [(png, "plot")]
        for table in tables:
            if table.rows:
                path = self.folder / f"{self.run_name}_{table.file_stem}.json"
                path.write_text(json.dumps({"columns": list(table.columns), "data": table.as_lists()}))
                files.append((path, table.file_stem))
        files.append((spec_yaml, "spec"))
        for path, kind in files:
            if path is not None:
                self.run.log_artifact(str(path), name=f"{self.run_name}-{kind}", type=kind)

    def close(self) -> None:
        if self.run is None:
            return
        from trackio import context_vars

        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
        if context_vars.current_run.get() is self.run:  # else trackio's exit hook finishes it again, printing
            context_vars.current_run.set(None)
