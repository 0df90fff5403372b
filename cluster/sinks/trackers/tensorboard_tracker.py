"""TensorBoard as a tracker (``metrics.trackers: [tensorboard]``): event files in ``output_dir/tensorboard``, written
through ``torch.utils.tensorboard.SummaryWriter``.

The configuration and ``spec.yaml`` as text at step 0; every number as a scalar at its step; at the end the plot as
an image and each table as a Markdown text, at the last step of the tables (:func:`common.last_step`); each step's
sample tables as Markdown texts at the step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.sinks.trackers.common import last_step, markdown_table
from contract.trackers import Table

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker:
    """TensorBoard event files in ``output_dir/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``)."""

    name = "tensorboard"
    package = "tensorboard"
    install = "tensorboard (pip install -e '.[tensorboard]')"

    def __init__(self, spec, output_dir: Path):
        self.logdir = output_dir / "tensorboard"
        self.writer = None

    def location(self) -> str:
        return str(self.logdir.resolve())

    def open(self, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.logdir))
        text = json.dumps(config, indent=1, sort_keys=True)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, numbers: Mapping[str, float]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, step: int, table: Table) -> None:
        self.writer.add_text(table.name, markdown_table(table), step)

    def artifacts(self, png: Path | None, tables: Sequence[Table], spec_yaml: Path | None) -> None:
        step = last_step(tables)
        if png is not None:
            from matplotlib.image import imread

            self.writer.add_image("plot", imread(str(png))[..., :3], step, dataformats="HWC")
        for table in tables:
            if table.rows:
                self.writer.add_text(table.name, markdown_table(table), step)
        if spec_yaml is not None:
            self.writer.add_text("spec", "\n".join("    " + line for line in spec_yaml.read_text().splitlines()), 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
