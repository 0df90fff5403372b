"""The four trackers behind :class:`cluster.ops.trackers.TrackerSink`, each over its library's own local mode.

Each backend is built with ``(spec, output_dir)`` and has ``open(config)``, ``log(step, numbers)``,
``artifacts(png, eval_rows, spec_yaml)`` and ``close()``; any of them may raise (the sink reports it once and stops
calling). Libraries are imported in ``open``, so naming a tracker costs nothing until the job starts.

- wandb: ``output_dir/wandb/offline-run-*`` (offline unless ``metrics.wandb_mode``); the config through
  ``wandb.init(config=)``; the plot as a ``wandb.Image``, the eval table as a ``wandb.Table``, ``spec.yaml`` as a run
  file.
- MLflow: an SQLite store ``output_dir/mlflow/mlflow.db`` with artifacts in ``output_dir/mlflow/artifacts`` (unless
  ``metrics.mlflow_tracking_uri``); the config as params with dotted keys and the commit as a tag; artifacts
  ``plot.png``, ``eval_table.json`` (``mlflow.log_table``'s layout) and ``spec.yaml``.
- TensorBoard: event files in ``output_dir/tensorboard``; the config and ``spec.yaml`` as text, the plot as an image,
  the eval table as a Markdown text.
- trackio: its SQLite database ``<project>.db`` in ``$TRACKIO_DIR`` or ``output_dir/trackio``; the config through
  ``trackio.init(config=)``; artifacts for the plot, ``eval_table.json`` and ``spec.yaml``.

Metric keys are the ``metrics.jsonl`` keys unchanged (``reward/mean``, ``actor/kl``; wandb, TensorBoard and trackio
group them by the part before ``/``). wandb plots them against a ``step`` metric (``define_metric``), so steps logged
again after a guard rollback are kept rather than refused for going backwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

__all__ = ["BACKENDS", "EVAL_COLUMNS", "Backend", "MlflowBackend", "TensorBoardBackend", "TrackioBackend",
           "WandbBackend", "flatten"]

#: Columns of the held-out evaluation table, in order (``step`` first).
EVAL_COLUMNS: tuple[str, ...] = ("step", "eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high", "eval/n",
                                 "eval/format_rate", "eval/response_length_mean", "eval/truncated_fraction")
DEFAULT_PROJECT = "grpo-cluster"


class Backend(Protocol):
    """What a tracker does for its :class:`~cluster.ops.trackers.TrackerSink` (module docstring)."""

    name: str

    def open(self, config: dict) -> None: ...

    def log(self, step: int, numbers: dict[str, float]) -> None: ...

    def artifacts(self, png: Path | None, eval_rows: list[list[Any]], spec_yaml: Path | None) -> None: ...

    def close(self) -> None: ...


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"spec.train.lr": "1e-06", ...}``: dotted keys, values as JSON text (strings unquoted)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _markdown_table(columns: tuple[str, ...], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it)."""
    cells = [" | ".join(columns), " | ".join("---" for _ in columns)]
    cells += [" | ".join("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row)
              for row in rows]
    return "\n".join(cells)


class WandbBackend:
    """wandb, offline by default (``metrics.wandb_mode``; ``$WANDB_MODE``); files under ``output_dir/wandb``."""

    name = "wandb"

    def __init__(self, spec, output_dir: Path):
        self.dir, self.run_name = output_dir, spec.name
        self.project = spec.metrics.project or DEFAULT_PROJECT
        self.mode = spec.metrics.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        self.run = None

    def open(self, config: dict) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(project=self.project, name=self.run_name, dir=str(self.dir), mode=self.mode,
                              config=config, settings=settings, reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log({"step": step, **numbers})

    def artifacts(self, png: Path | None, eval_rows: list[list[Any]], spec_yaml: Path | None) -> None:
        import wandb

        row: dict[str, Any] = {}
        if png is not None:
            row["plot"] = wandb.Image(str(png))
        if eval_rows:
            row["eval/table"] = wandb.Table(columns=list(EVAL_COLUMNS), data=eval_rows)
        if row:
            self.run.log(row)
        if spec_yaml is not None:
            self.run.save(str(spec_yaml), base_path=str(spec_yaml.parent), policy="now")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MlflowBackend:
    """MLflow through ``MlflowClient`` (no global active run): ``metrics.mlflow_tracking_uri``,
    ``$MLFLOW_TRACKING_URI``, or an SQLite store in ``output_dir/mlflow``; experiment ``metrics.project``."""

    name = "mlflow"

    def __init__(self, spec, output_dir: Path):
        self.experiment, self.run_name = spec.metrics.project or DEFAULT_PROJECT, spec.name
        self.uri = spec.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.folder = None if self.uri else (output_dir / "mlflow").resolve()
        if self.folder is not None:
            self.uri = f"sqlite:///{self.folder / 'mlflow.db'}"
        self.client = self.run_id = None

    def open(self, config: dict) -> None:
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

    def log(self, step: int, numbers: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numbers.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def artifacts(self, png: Path | None, eval_rows: list[list[Any]], spec_yaml: Path | None) -> None:
        for path in (png, spec_yaml):
            if path is not None:
                self.client.log_artifact(self.run_id, str(path))
        if eval_rows:  # the layout mlflow.log_table writes, so the UI shows it as a table
            self.client.log_dict(self.run_id, {"columns": list(EVAL_COLUMNS), "data": eval_rows}, "eval_table.json")

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)


class TensorBoardBackend:
    """TensorBoard event files in ``output_dir/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``)."""

    name = "tensorboard"

    def __init__(self, spec, output_dir: Path):
        self.logdir = output_dir / "tensorboard"
        self.writer = None

    def open(self, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.logdir))
        text = json.dumps(config, indent=1, sort_keys=True)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def artifacts(self, png: Path | None, eval_rows: list[list[Any]], spec_yaml: Path | None) -> None:
        step = max((row[0] for row in eval_rows if isinstance(row[0], int)), default=0)
        if png is not None:
            from matplotlib.image import imread

            self.writer.add_image("plot", imread(str(png))[..., :3], step, dataformats="HWC")
        if eval_rows:
            self.writer.add_text("eval/table", _markdown_table(EVAL_COLUMNS, eval_rows), step)
        if spec_yaml is not None:
            self.writer.add_text("spec", "\n".join("    " + line for line in spec_yaml.read_text().splitlines()), 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TrackioBackend:
    """trackio's local SQLite database: ``$TRACKIO_DIR`` when set, else ``output_dir/trackio`` (trackio reads the
    folder when it is first imported, so a process that imported it earlier keeps its folder: :attr:`location`)."""

    name = "trackio"

    def __init__(self, spec, output_dir: Path):
        self.project, self.run_name = spec.metrics.project or DEFAULT_PROJECT, spec.name
        self.wanted = Path(os.environ.get("TRACKIO_DIR") or output_dir / "trackio")
        self.location: Path | None = None
        self.run = None

    def open(self, config: dict) -> None:
        if not os.environ.get("TRACKIO_DIR"):  # unset or empty: trackio would take $HF_HOME/trackio
            os.environ["TRACKIO_DIR"] = str(self.wanted)
        import trackio
        from trackio import utils

        self.location = Path(utils.TRACKIO_DIR)
        self.location.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):  # trackio prints a banner
            self.run = trackio.init(project=self.project, name=self.run_name, config=config, embed=False,
                                    auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def artifacts(self, png: Path | None, eval_rows: list[list[Any]], spec_yaml: Path | None) -> None:
        table = None
        if eval_rows:
            table = self.location / f"{self.run_name}_eval_table.json"
            table.write_text(json.dumps({"columns": list(EVAL_COLUMNS), "data": eval_rows}))
        for path, kind in ((png, "plot"), (table, "eval_table"), (spec_yaml, "spec")):
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


#: tracker name → backend class
BACKENDS: dict[str, type] = {"wandb": WandbBackend, "mlflow": MlflowBackend, "tensorboard": TensorBoardBackend,
                             "trackio": TrackioBackend}
