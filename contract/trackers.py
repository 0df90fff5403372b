"""An experiment tracker (wandb, MLflow, TensorBoard, trackio, ...): the protocol one implementation module fulfils.

The job's metric sinks (``cluster.sinks``) wrap each tracker named in ``metrics.trackers`` in a sink that never stops
the job (``cluster.sinks.trackers.TrackerSink``); the implementations are chosen by name from the registry
``cluster.sinks.trackers.registry.TRACKERS``, one module each (docs/trackers.md, "Adding a tracker").

What crosses this seam is plain data: numbers keyed by the ``metrics.jsonl`` keys, the run configuration, file paths
and :class:`Table` — a named table of rows, which a tracker writes in its own form (a ``wandb.Table``, MLflow's
``log_table`` JSON layout, a TensorBoard Markdown text, a trackio table). The held-out evaluation table is given at
the end of the job with the other artifacts; the step's samples (``samples/train``, ``samples/eval``: one row per
completion) are given every step to a tracker's ``log_table(step, table)`` (see :class:`Tracker`).

Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = ["Table", "Tracker"]


@dataclass(frozen=True)
class Table:
    """A named table: ``rows[i][j]`` is the value of ``columns[j]`` in row ``i``.

    Attributes:
        name: the key it is logged under, ``group/name`` like a metric key (``"eval/table"``); a tracker that needs a
            file name uses ``name`` with ``/`` replaced by ``_`` (``eval_table.json``).
        columns: the column names, in order.
        rows: each a sequence of ``len(columns)`` values: str, int, float, bool or None (a column not logged).
    """

    name: str
    columns: tuple[str, ...]
    rows: Sequence[Sequence[Any]]

    @property
    def file_stem(self) -> str:
        """``name`` as a file name without suffix: ``"eval/table"`` → ``"eval_table"``."""
        return self.name.replace("/", "_")

    def as_lists(self) -> list[list[Any]]:
        """The rows as lists (what JSON writers and ``wandb.Table(data=...)`` take)."""
        return [list(row) for row in self.rows]


@runtime_checkable
class Tracker(Protocol):
    """One tracker's run. Built with ``(spec, output_dir)`` (the job's spec and its folder, a ``pathlib.Path``)
    without touching its library; the library is imported in :meth:`open`, so naming a tracker costs nothing until
    the job starts. Any method may raise: the sink wrapping it reports the first failure once and calls it no more.

    A tracker may also have ``log_table(step: int, table: Table) -> None``, which writes a table logged at ``step``
    in the tracker's native table form (a ``wandb.Table``, an MLflow table artifact, a TensorBoard text, a trackio
    table); the step's samples come through it (a tracker without it gets none).

    Class attributes:
        name: the name ``metrics.trackers`` selects it by (its registry key).
        package: the import name of its library, looked up (not imported) before the job starts.
        install: how to install that library, for the message when it is missing (``"wandb (pip install -e
            '.[wandb]')"``).
    """

    name: ClassVar[str]
    package: ClassVar[str]
    install: ClassVar[str]

    def location(self) -> str:
        """Where the run goes, for ``grpo-cluster validate`` (a folder, a store URI without its password, ...)."""
        ...

    def open(self, config: Mapping[str, Any]) -> None:
        """Start the run and record ``config`` (the spec as JSON data, ``git_commit``, ``grpo_cluster_version``)."""
        ...

    def log(self, step: int, numbers: Mapping[str, float]) -> None:
        """The step's finite numbers, keyed by their ``metrics.jsonl`` keys."""
        ...

    def artifacts(self, png: Path | None, tables: Sequence[Table], spec_yaml: Path | None) -> None:
        """At the end of the job: the run picture (``plot.png``, None when nothing was drawn), the tables (the
        held-out evaluation table when the job evaluated) and ``spec.yaml`` (None when absent)."""
        ...

    def close(self) -> None:
        """Finish the run (called once)."""
        ...
