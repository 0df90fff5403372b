"""A run folder as the report reads it: its metrics (``metrics.jsonl``, as ``grpo-cluster plot`` reads it), its
samples (``samples.jsonl``), its end-of-run summary (``summary.txt``, when the run wrote one) and what the reading
left out.

Nothing in a run folder's content makes the reading fail except what ``grpo-cluster plot`` refuses (no folder, no
``metrics.jsonl``, a line before its last that is not JSON, no step record): a torn ``samples.jsonl`` line, a record
of an unknown shape, a run still being written are each left out or read as far as they go, with a one-line note.
The samples embedded in the page are bounded: at most :data:`MAX_TRAIN_STEPS` steps of training samples (evenly
spaced, the first and the last among them) and :data:`MAX_EVAL_PROBLEMS` problems per evaluation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.sinks.plot import PlotData, job_name, plot_data, run_records, with_recorded_trips
from cluster.sinks.samples import SAMPLES_FILE, read_samples

__all__ = ["MAX_EVAL_PROBLEMS", "MAX_TRAIN_STEPS", "RunView", "read_run"]

#: Steps of training samples a page holds at most (a long run's are thinned evenly).
MAX_TRAIN_STEPS = 200
#: Held-out problems per evaluation a page holds at most (the first ones).
MAX_EVAL_PROBLEMS = 500
SUMMARY_TXT, SUMMARY_JSON = "summary.txt", "summary.json"


@dataclass
class RunView:
    """What the report shows of one run folder.

    Attributes:
        run_dir: the folder. name: the job's name (``spec.yaml``, else the folder's). records: metrics.jsonl's step
        records. data: their plot panels (guard trips included). train: step → its sampled groups' records (each
        ``kind: "train"``, ``cluster.loop.samples``). evals: step → its evaluation's per-problem records.
        summary: ``summary.txt``'s text, None without one. total_steps: the spec's (None when unknown).
        notes: what was left out, and whether the run is still being written, one line each.
    """

    run_dir: Path
    name: str
    records: list[dict[str, Any]]
    data: PlotData
    train: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    evals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    summary: str | None = None
    total_steps: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in self.records), default=0)


def _total_steps(run_dir: Path) -> int | None:
    import yaml

    try:
        value = yaml.safe_load((run_dir / "spec.yaml").read_text(encoding="utf-8")).get("total_steps")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _well_formed(record: dict[str, Any]) -> bool:
    """A record the page can show: ``kind`` train or eval, a list of completion objects."""
    completions = record.get("completions")
    return record.get("kind") in ("train", "eval") and isinstance(completions, list) and all(
        isinstance(c, dict) for c in completions)


def _thinned(steps: list[int], keep: int) -> list[int]:
    """``keep`` of ``steps`` (ascending), evenly spaced, the first and the last among them."""
    if len(steps) <= keep:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (keep - 1))] for i in range(keep)})


def _samples(run_dir: Path, notes: list[str]) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """(train, evals) of the run's samples.jsonl (:class:`RunView`), bounded (module docstring); a step's records
    logged again (a rollback or a resume redid it) replace the earlier ones."""
    path = run_dir / SAMPLES_FILE
    try:
        records = read_samples(path, notes)
    except OSError as exc:
        notes.append(f"{path}: cannot be read ({exc.strerror or exc}); the page has no samples")
        return {}, {}
    if not path.is_file():
        notes.append(f"{path}: not found (a run without metrics.samples_per_step, or from before it); the page has "
                     f"no samples")
    shaped = [r for r in records if _well_formed(r)]
    if len(shaped) < len(records):
        notes.append(f"{path}: left out {len(records) - len(shaped)} record(s) of an unknown shape (expected kind "
                     f"'train' or 'eval' with a list of completions)")
    by_kind: dict[str, dict[int, list[dict]]] = {"train": {}, "eval": {}}
    last_seen: dict[tuple[str, int], int] = {}
    for index, record in enumerate(shaped):
        key = (record["kind"], record["step"])
        if key in last_seen and last_seen[key] != index - 1:
            by_kind[key[0]][key[1]] = []  # logged again after other steps: the later logging wins
        by_kind[key[0]].setdefault(key[1], []).append(record)
        last_seen[key] = index
    train, evals = by_kind["train"], by_kind["eval"]
    kept = _thinned(sorted(train), MAX_TRAIN_STEPS)
    if len(kept) < len(train):
        notes.append(f"{path}: {len(train)} steps of samples; the page holds {len(kept)} of them, evenly spaced")
    for step, problems in evals.items():
        if len(problems) > MAX_EVAL_PROBLEMS:
            notes.append(f"{path}: the evaluation after step {step} has {len(problems)} problems; the page holds "
                         f"the first {MAX_EVAL_PROBLEMS}")
            evals[step] = problems[:MAX_EVAL_PROBLEMS]
    return {step: train[step] for step in kept}, evals


def _summary_state(run_dir: Path, view: RunView) -> str:
    """``current`` when ``summary.json`` describes the run as its folder holds it now, ``stale`` when it was written
    at an earlier end (a resumed run: metrics.jsonl holds more trained steps than it counted, or spec.yaml another
    ``total_steps``), ``missing`` without a readable one."""
    try:
        summary = json.loads((run_dir / SUMMARY_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return "missing"
    if not isinstance(summary, dict):
        return "missing"
    trained = sum(1 for r in view.records if r["step"] >= 1 and "policy_version" in r)  # as build_summary counts
    steps, total = summary.get("steps"), summary.get("total_steps")
    if isinstance(steps, int) and steps < trained:
        return "stale"
    if view.total_steps is not None and isinstance(total, int) and total != view.total_steps:
        return "stale"
    return "current"


def read_run(run_dir: str | Path) -> RunView:
    """Read a run folder for the report.

    Raises:
        PlotError: as ``cluster.sinks.plot.run_records`` (not a folder, no metrics.jsonl, a line before its last
            that is not JSON, no step record).
    """
    run_dir = Path(run_dir)
    notes: list[str] = []
    records = run_records(run_dir, notes)
    view = RunView(run_dir, job_name(run_dir), records, with_recorded_trips(plot_data(records), run_dir),
                   total_steps=_total_steps(run_dir), notes=notes)
    view.train, view.evals = _samples(run_dir, notes)
    try:
        view.summary = (run_dir / SUMMARY_TXT).read_text(encoding="utf-8", errors="replace")
    except OSError:
        view.summary = None
    summary = _summary_state(run_dir, view)
    if summary == "stale":
        notes.append(f"{run_dir / SUMMARY_JSON}: describes an earlier end of this run (fewer steps, or another "
                     f"total_steps, than metrics.jsonl and spec.yaml hold now: a resumed run); its summary is not "
                     f"this run's end")
    finished = summary == "current" or (view.total_steps is not None and view.last_step >= view.total_steps)
    if not finished:
        of = f" of total_steps {view.total_steps}" if view.total_steps is not None else ""
        notes.append(f"{run_dir}: the run is still being written, or stopped early: its last step is "
                     f"{view.last_step}{of} and it has no {SUMMARY_JSON} of its end yet; the page shows what is there")
    return view

