"""Where the step's samples go: ``<output_dir>/samples.jsonl`` (:class:`SampleLog`, a metric sink) and each
tracker's table (:func:`samples_tables`, which ``cluster.sinks.trackers.TrackerSink`` logs per step).

The records are made by the loop (``cluster.loop.samples``: a few groups per step, ``kind: "train"``, and every
problem of a held-out evaluation, ``kind: "eval"``); one JSON object per line, each with its ``step``, so a resume or
a rollback cuts the file back like ``metrics.jsonl`` (``cluster.loop.checkpoint_state.STEP_LOGS``) and
:meth:`SampleLog.reopen` follows the new file. :func:`read_samples` reads it back, leaving out lines that are not
records (a torn last line of a crash, or of a job still writing) with a note, never failing on one.

In a tracker the records are two tables (:class:`contract.trackers.Table`) logged at their step: ``samples/train``
(one row per completion: :data:`TRAIN_COLUMNS`) and ``samples/eval`` (one row per held-out completion:
:data:`EVAL_COLUMNS`); the per-token data stays in ``samples.jsonl``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contract.trackers import Table

__all__ = ["EVAL_COLUMNS", "SAMPLES_FILE", "TRAIN_COLUMNS", "SampleLog", "read_samples", "samples_tables"]

SAMPLES_FILE = "samples.jsonl"

#: Columns of the ``samples/train`` table: one row per completion of a sampled group.
TRAIN_COLUMNS: tuple[str, ...] = ("step", "group_id", "completion", "prompt", "text", "reward", "rewards",
                                  "advantage", "finish_reason", "length", "policy_version", "staleness", "excluded",
                                  "turns", "tool_calls")
#: Columns of the ``samples/eval`` table: one row per completion of a held-out problem.
EVAL_COLUMNS: tuple[str, ...] = ("step", "problem", "completion", "prompt", "reference", "text", "correct", "format",
                                 "finish_reason", "length")


class SampleLog:
    """Appends the step's sample records to ``<output_dir>/samples.jsonl`` (a ``contract.protocols.MetricSink`` that
    takes nothing but samples).

    Attributes:
        path: the file. seconds: wall seconds spent writing so far. url: None (no Prometheus endpoint).
    """

    url = None

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = None  # opened on the first records
        self.seconds = 0.0

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Metrics go to the other sinks."""

    def log_worker(self, step: int, pool: str, worker: str, metrics: Mapping[str, Any]) -> None:
        """Per-worker figures go to the other sinks."""

    def remove_worker(self, pool: str, worker: str) -> int:
        return 0

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` (JSON objects with ``step``; NaN is refused: the loop writes None) as lines.

        Raises:
            ValueError: a record without ``step`` == ``step``.
        """
        t0 = time.perf_counter()
        wrong = [r.get("step") for r in records if r.get("step") != step]
        if wrong:
            raise ValueError(f"sample records of step {step} must carry 'step': {step}; got {wrong[:3]}")
        text = "".join(json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n" for record in records)
        with self._lock:
            if self._file is None:
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(text)
            self._file.flush()
        self.seconds += time.perf_counter() - t0

    def reopen(self) -> None:
        """Follow ``samples.jsonl`` after a rollback or resume replaced it (cut back to a checkpoint's step)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = None

    def close(self) -> None:
        self.reopen()


def _cell(value: Any) -> Any:
    """A table cell: str, int, float, bool or None as they are; anything else as JSON text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _train_rows(record: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for c in record.get("completions", []):
        episode = c.get("episode") or {}
        rows.append([_cell(v) for v in (
            record.get("step"), record.get("group_id"), c.get("index"), c.get("prompt", record.get("prompt")),
            c.get("text"), c.get("reward"), c.get("rewards"), c.get("advantage"), c.get("finish_reason"),
            c.get("length"), record.get("policy_version"), c.get("staleness"), c.get("excluded"),
            episode.get("turns"), episode.get("tool_calls"))])
    return rows


def _eval_rows(record: Mapping[str, Any]) -> list[list[Any]]:
    return [[_cell(v) for v in (
        record.get("step"), record.get("problem"), c.get("index"), record.get("prompt"), record.get("reference"),
        c.get("text"), c.get("correct"), c.get("format"), c.get("finish_reason"), c.get("length"))]
        for c in record.get("completions", [])]


def samples_tables(records: Sequence[Mapping[str, Any]]) -> list[Table]:
    """The tracker tables of one step's records: ``samples/train`` and ``samples/eval``, each only when it has rows
    (records of another ``kind`` are left out)."""
    train = [row for r in records if r.get("kind") == "train" for row in _train_rows(r)]
    evals = [row for r in records if r.get("kind") == "eval" for row in _eval_rows(r)]
    return [table for table in (Table("samples/train", TRAIN_COLUMNS, train), Table("samples/eval", EVAL_COLUMNS,
                                                                                     evals)) if table.rows]


def read_samples(path: str | Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of a ``samples.jsonl`` file, in order; [] when the file does not exist.

    A line that is not a JSON object with an int ``step`` (a torn line: a crash mid-write, or the job still writing
    its last line) is left out, with one note per file in ``notes`` naming the lines.

    Raises:
        OSError: the file exists but cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records, bad = [], []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                bad.append(line_no)
    if bad and notes is not None:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        notes.append(f"{path}: left out {len(bad)} line(s) that are not sample records (line {shown}: torn by a "
                     f"crash, or still being written)")
    return records
