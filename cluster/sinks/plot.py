"""``grpo-cluster plot RUN_DIR``: one PNG of a run's learning curves from its ``metrics.jsonl``.

Panels, all against the training step (x axis, shared):

1. reward components: ``reward/mean`` and every ``reward/<function>`` (the driver's other summaries ``reward/std``,
   ``reward/failed``, ``reward/none_fraction``, ``reward/infra_failed``, ``reward/not_applicable`` and the counts
   ``reward/scored/<function>`` are left out: they are not rewards);
2. held-out accuracy: ``eval/accuracy`` with its 95 % interval ``eval/accuracy_ci_low`` .. ``eval/accuracy_ci_high`` as
   a band, and ``eval/best_accuracy``; evaluations are sparse (every ``eval.every_steps`` steps), so points are marked;
3. response length: ``response_length/mean`` (tokens);
4. KL: ``actor/kl`` (nats per token to the reference policy);
5. guard: one row per detector ``monitor/<name>`` (``grpo.monitor.DETECTORS``) with a mark on each step it fired.

Every step with ``monitor/tripped`` == 1 is also drawn as a red vertical line across all panels. A panel whose keys are
absent from the file says "not logged" instead of drawing; nothing in the file's content makes the plot fail except a
line that is not JSON before the last one. A running job may be writing its last line: a last line that is not JSON
(and has no line break after it) is left out with a note, so ``plot`` works while the job runs.

The title is the job's name (``name`` in the run folder's ``spec.yaml``, which every job writes there; the folder's
name without one) and the number of training steps (steps >= 1; the step-0 row is the evaluation of the starting
weights, not a step).

The data each panel draws is computed by :func:`plot_data` (no matplotlib), the drawing by :func:`render_png`
(matplotlib's Agg canvas, no display needed, pyplot's global state untouched).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from grpo.monitor import DETECTORS, TRIPPED_KEY
from grpo.rewards import REWARD_SUMMARY_METRICS

__all__ = ["PlotData", "PlotError", "Series", "interval_band", "job_name", "plot_data", "plot_run", "read_records",
           "render_png", "run_data", "run_records", "series", "with_recorded_trips"]

METRICS_FILE = "metrics.jsonl"
DEFAULT_PNG = "plot.png"
GUARD_RECORD = Path("checkpoints") / "guard.json"
"""Where the guard records its trips (``<checkpoint.dir>/guard.json``; the default checkpoint dir of a run)."""
EVAL_KEY, EVAL_LOW_KEY, EVAL_HIGH_KEY = "eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high"
EVAL_BEST_KEY = "eval/best_accuracy"
LENGTH_KEY, KL_KEY = "response_length/mean", "actor/kl"
REWARD_PREFIX = "reward/"
#: reward/<summary> keys that are not a reward (counts, spread) and stay off the reward panel
NOT_REWARDS = frozenset(f"{REWARD_PREFIX}{name}" for name in REWARD_SUMMARY_METRICS if name != "mean")


class PlotError(ValueError):
    """The run folder or its metrics.jsonl is missing, unreadable or holds no step records."""


@dataclass(frozen=True)
class Series:
    """One metric over the steps that logged it.

    key: the metrics.jsonl key. steps: int steps, ascending, distinct. values: float, finite, one per step.
    """

    key: str
    steps: tuple[int, ...]
    values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class PlotData:
    """What each panel draws; an empty tuple (or None) means the panel's keys were not logged.

    rewards: ``reward/mean`` first, then the components in alphabetical order. eval_accuracy, eval_low, eval_high,
    eval_best: the held-out accuracy series (fractions in [0, 1]); the band is drawn over the steps that have both
    bounds. length: mean response length, tokens. kl: nats per token. detectors: detector name → steps on which
    ``monitor/<name>`` was 1, for every detector the file logs. trips: steps with ``monitor/tripped`` == 1.
    guard_logged: whether any ``monitor/*`` key is in the file. num_steps: distinct training steps in the file (steps
    >= 1; a step-0 row holds the starting weights' evaluation).
    """

    rewards: tuple[Series, ...]
    eval_accuracy: Series | None
    eval_low: Series | None
    eval_high: Series | None
    eval_best: Series | None
    length: Series | None
    kl: Series | None
    detectors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    trips: tuple[int, ...] = ()
    guard_logged: bool = False
    num_steps: int = 0


def _finite(value: Any) -> float | None:
    """A JSON number (bool → 0/1) as float if finite, else None (null, strings, NaN written as null)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range
            return None
        return number if math.isfinite(number) else None
    return None


def _step(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def series(records: Sequence[Mapping[str, Any]], key: str) -> Series | None:
    """The (step, value) pairs of ``key`` over the records that hold it as a finite number, ascending by step; None
    when no record does. A step logged again (a run that rolled back or resumed redoes steps) keeps its last value,
    the one the run's history now holds. Records without an int ``step`` are ignored."""
    by_step: dict[int, float] = {}
    for record in records:
        step, value = _step(record), _finite(record.get(key))
        if step is not None and value is not None:
            by_step[step] = value
    if not by_step:
        return None
    steps = tuple(sorted(by_step))
    return Series(key, steps, tuple(by_step[s] for s in steps))


def _steps_where_one(records: Sequence[Mapping[str, Any]], key: str) -> tuple[int, ...]:
    """Steps on which any record has ``key`` >= 1 (a trip stays visible after a rollback redid its step)."""
    return tuple(sorted({step for record in records if (step := _step(record)) is not None
                         and (value := _finite(record.get(key))) is not None and value >= 1.0}))


def plot_data(records: Sequence[Mapping[str, Any]]) -> PlotData:
    """Extract every panel's series from metrics.jsonl records (dicts with an int ``step``; see module doc)."""
    keys = {k for record in records for k in record}
    components = sorted(k for k in keys if k.startswith(REWARD_PREFIX) and k not in NOT_REWARDS
                        and k != f"{REWARD_PREFIX}mean" and k.count("/") == 1)  # not reward/scored/<name>
    rewards = tuple(s for s in (series(records, k) for k in (f"{REWARD_PREFIX}mean", *components)) if s)
    detectors = {name: _steps_where_one(records, f"monitor/{name}") for name in DETECTORS
                 if f"monitor/{name}" in keys}
    return PlotData(
        rewards=rewards,
        eval_accuracy=series(records, EVAL_KEY), eval_low=series(records, EVAL_LOW_KEY),
        eval_high=series(records, EVAL_HIGH_KEY), eval_best=series(records, EVAL_BEST_KEY),
        length=series(records, LENGTH_KEY), kl=series(records, KL_KEY),
        detectors=detectors, trips=_steps_where_one(records, TRIPPED_KEY),
        guard_logged=any(k.startswith("monitor/") for k in keys),
        num_steps=len({s for s in map(_step, records) if s is not None and s >= 1}),
    )


def interval_band(low: Series, high: Series) -> tuple[list[int], list[float], list[float]]:
    """Steps with both interval bounds (a step's last bounds win), ascending, and the bounds there."""
    lows, highs = dict(zip(low.steps, low.values)), dict(zip(high.steps, high.values))
    steps = sorted(set(lows) & set(highs))
    return steps, [lows[s] for s in steps], [highs[s] for s in steps]


def _not_logged(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not logged", transform=ax.transAxes, ha="center", va="center", color="0.4")


def _draw_rewards(ax, data: PlotData) -> None:
    ax.set_title("Reward components (training samples)", loc="left", fontsize=10)
    if not data.rewards:
        return _not_logged(ax, "reward/*")
    for s in data.rewards:
        style = {"color": "black", "linewidth": 2.0} if s.key == f"{REWARD_PREFIX}mean" else {"linewidth": 1.2}
        ax.plot(s.steps, s.values, label=s.key, **style)
    ax.set_ylabel("reward")
    ax.legend(fontsize=8, loc="best")


def _draw_eval(ax, data: PlotData) -> None:
    ax.set_title("Held-out accuracy (95 % Wilson interval)", loc="left", fontsize=10)
    if data.eval_accuracy is None:
        return _not_logged(ax, EVAL_KEY)
    if data.eval_low is not None and data.eval_high is not None:
        steps, lows, highs = interval_band(data.eval_low, data.eval_high)
        ax.fill_between(steps, lows, highs, color="tab:green", alpha=0.2, label="95 % interval")
    ax.plot(data.eval_accuracy.steps, data.eval_accuracy.values, "o-", color="tab:green", label=EVAL_KEY)
    if data.eval_best is not None:
        ax.plot(data.eval_best.steps, data.eval_best.values, "--", color="0.3", label=EVAL_BEST_KEY)
    ax.set_ylabel("pass@1")
    ax.legend(fontsize=8, loc="best")


def _draw_line(ax, line: Series | None, title: str, ylabel: str, key: str) -> None:
    ax.set_title(title, loc="left", fontsize=10)
    if line is None:
        return _not_logged(ax, key)
    ax.plot(line.steps, line.values, color="tab:blue")
    ax.set_ylabel(ylabel)


def _draw_guard(ax, data: PlotData) -> None:
    ax.set_title("Reward-hacking guard (detectors that fired)", loc="left", fontsize=10)
    if not data.guard_logged:
        return _not_logged(ax, "monitor/*")
    names = list(data.detectors) or list(DETECTORS)
    for row, name in enumerate(names):
        steps = data.detectors.get(name, ())
        ax.plot(steps, [row] * len(steps), "|", color="tab:red", markersize=12, markeredgewidth=2)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(-0.5, len(names) - 0.5)
    if not data.trips:
        ax.text(0.99, 0.95, "no trips", transform=ax.transAxes, ha="right", va="top", color="tab:green")


def render_png(data: PlotData, out: str | Path, title: str = "") -> Path:
    """Draw the five panels of ``data`` into a PNG at ``out`` (parent folders created); returns ``out``.

    Raises OSError when the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 13), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(5, 1, sharex=True)
    _draw_rewards(axes[0], data)
    _draw_eval(axes[1], data)
    _draw_line(axes[2], data.length, "Response length (mean)", "tokens", LENGTH_KEY)
    _draw_line(axes[3], data.kl, "KL to the reference policy", "nats/token", KL_KEY)
    _draw_guard(axes[4], data)
    for ax in axes:
        for step in data.trips:
            ax.axvline(step, color="tab:red", alpha=0.35, linewidth=1.0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    trips = f", guard tripped at step {data.trips[0]}" if data.trips else ""
    fig.suptitle(f"{title} ({data.num_steps} steps{trips})" if title else f"{data.num_steps} steps{trips}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None,
             notes: list[str] | None = None) -> Path:
    """Read ``RUN_DIR/metrics.jsonl`` and write the PNG (default ``RUN_DIR/plot.png``); returns its path.

    Args:
        title: the figure's title; None: :func:`job_name` of the run folder.
        notes: when given, what was left out of the file (a partial last line) is appended to it, for the caller to
            print.

    Raises:
        PlotError: as :func:`run_data`; values cannot be drawn; or ``out`` is not a ``.png`` name or would overwrite a
            file that is not a PNG.
        OSError: the PNG cannot be written.
    """
    run_dir = Path(run_dir)
    out = run_dir / DEFAULT_PNG if out is None else Path(out)
    _check_out(out, run_dir / METRICS_FILE)
    data = run_data(run_dir, notes)
    try:
        return render_png(data, out, title=job_name(run_dir) if title is None else title)
    except (ValueError, OverflowError) as exc:  # values matplotlib cannot place on an axis (e.g. ±1e308)
        raise PlotError(f"{run_dir / METRICS_FILE}: cannot draw its values ({type(exc).__name__}: {exc})") from None


def job_name(run_dir: str | Path) -> str:
    """The job's ``name`` from ``RUN_DIR/spec.yaml`` (written by every job at start), else the folder's name."""
    import yaml

    run_dir = Path(run_dir)
    try:
        name = yaml.safe_load((run_dir / "spec.yaml").read_text(encoding="utf-8")).get("name")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        name = None
    return name if isinstance(name, str) and name else run_dir.resolve().name


def read_records(path: Path, notes: list[str] | None = None) -> list[Any]:
    """The JSON records of a metrics.jsonl file, leaving out a last line that is still being written (not JSON and
    not ended by a line break: a running job's), with a note appended to ``notes``.

    Raises:
        ValueError: any other line is not JSON (file:line). OSError, UnicodeDecodeError: the file cannot be read.
    """
    text = path.read_text(encoding="utf-8")
    head, _, last = text.rpartition("\n")
    if last.strip():
        try:
            json.loads(last)
        except ValueError:
            line_no = text.count("\n") + 1
            if notes is not None:
                notes.append(f"{path}:{line_no}: left out a partial last line ({len(last)} characters, no line "
                             f"break: the job is still writing it)")
            text = head + "\n"
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {exc.msg} at column {exc.colno}") from None
    return records


def run_data(run_dir: str | Path, notes: list[str] | None = None) -> PlotData:
    """The panels' data of a run folder: :func:`plot_data` of its metrics.jsonl (:func:`run_records`: a partial
    last line is left out, noted in ``notes``), plus the trips the guard recorded in ``checkpoints/guard.json``
    (:func:`with_recorded_trips`).

    Raises:
        PlotError: as :func:`run_records`.
    """
    return with_recorded_trips(plot_data(run_records(run_dir, notes)), run_dir)


def with_recorded_trips(data: PlotData, run_dir: str | Path) -> PlotData:
    """``data`` with the trips the guard recorded in ``RUN_DIR/checkpoints/guard.json`` added (a rollback cuts
    metrics.jsonl back before the tripped row)."""
    recorded = _recorded_trips(Path(run_dir) / GUARD_RECORD)
    return replace(data, trips=tuple(sorted(set(data.trips) | recorded))) if recorded else data


def run_records(run_dir: str | Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The step records of a run folder's metrics.jsonl (:func:`read_records`: a partial last line is left out,
    noted in ``notes``): the JSON objects with an int ``step``, in file order.

    Raises:
        PlotError: RUN_DIR is not a folder, has no metrics.jsonl, a line before the last is not JSON, or no record
            has a step.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "not found"
        raise PlotError(f"run folder {run_dir} {what} (absolute: {run_dir.absolute()}); expected a job's "
                        f"output_dir holding {METRICS_FILE}")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path}: no {METRICS_FILE} in the run folder; expected the output_dir of a job that ran "
                        f"at least one step")
    try:
        records = read_records(path, notes)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PlotError(f"cannot read {path}: {exc}") from None
    records = [r for r in records if isinstance(r, dict) and _step(r) is not None]
    if not records:
        raise PlotError(f"{path}: no step records (expected JSON lines with an int 'step')")
    return records


def _check_out(out: Path, metrics: Path) -> None:
    """Refuse an output that is not a ``.png`` name, is the run's metrics file, or would overwrite another kind of
    file (only an earlier PNG may be replaced)."""
    if out.suffix.lower() != ".png":
        raise PlotError(f"--out {out}: expected a .png file name (the plot is written as PNG)")
    if out.exists() and metrics.exists() and out.resolve() == metrics.resolve():
        raise PlotError(f"--out {out}: that is the run's {METRICS_FILE}; choose another file")
    if out.is_file():
        with out.open("rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                raise PlotError(f"--out {out}: exists and is not a PNG; refusing to overwrite it")


def _recorded_trips(path: Path) -> set[int]:
    """Steps of the trips the guard recorded in ``path`` (its ``guard.json``); empty when there is none or it cannot
    be read (the plot still draws what metrics.jsonl holds)."""
    try:
        trips = json.loads(path.read_text(encoding="utf-8")).get("trips", [])
        return {t["step"] for t in trips if isinstance(t.get("step"), int) and not isinstance(t["step"], bool)}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return set()
