"""The ``metrics`` section: ``metrics.jsonl``, console lines, the Prometheus endpoint and experiment trackers.

Trackers (``metrics.trackers``) are metric sinks beside ``metrics.jsonl`` and Prometheus (``cluster.ops.trackers``):
each receives the same per-step rows under the same keys, the spec and git commit as its run configuration, and at
the end of the job the ``plot`` picture and the held-out evaluation table as artifacts. Their files go under
``output_dir`` unless their own settings say otherwise.

Imports only pydantic and :mod:`cluster.spec.fields`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from cluster.spec.fields import MAX_COUNT, SPEC_CONFIG, NonEmptyStr

__all__ = ["TRACKERS", "MetricsSpec", "TrackerName"]

TrackerName = Literal["wandb", "mlflow", "tensorboard", "trackio"]
#: The trackers ``metrics.trackers`` may name, in the order their sinks are called.
TRACKERS: tuple[str, ...] = ("wandb", "mlflow", "tensorboard", "trackio")


class MetricsSpec(BaseModel):
    """metrics.jsonl in output_dir, console lines, a Prometheus endpoint and, optionally, experiment trackers."""

    model_config = SPEC_CONFIG
    host: NonEmptyStr = Field("127.0.0.1", description="Address the Prometheus HTTP server binds to.")
    port: int | None = Field(9300, ge=0, le=65535, strict=True, description=(
        "Prometheus port; 0 picks a free one, null disables."))
    log_every_steps: int = Field(1, ge=1, le=MAX_COUNT, strict=True, description=(
        "Print a console line every this many steps."))
    trackers: list[TrackerName] = Field(default_factory=list, description=(
        "Experiment trackers that receive every step's metrics (same keys as metrics.jsonl), the spec and git "
        "commit as the run's configuration, and at the end the plot picture and the eval table: any of 'wandb' "
        "(offline by default: files in output_dir/wandb), 'mlflow' (an SQLite store in output_dir/mlflow), "
        "'tensorboard' (event files in output_dir/tensorboard), 'trackio' (its SQLite database in "
        "output_dir/trackio unless $TRACKIO_DIR is set). Each needs its library (pip install -e '.[trackers]'); a "
        "tracker that fails warns once and is switched off, training goes on. [] (default): none."))
    project: str | None = Field(None, min_length=1, description=(
        "Project (wandb, trackio) or experiment (MLflow) the run is filed under; null: 'grpo-cluster'. The run is "
        "named after the job (name)."))
    wandb_mode: Literal["offline", "online"] | None = Field(None, description=(
        "wandb: 'offline' writes the run to output_dir/wandb only (upload later with `wandb sync`), 'online' "
        "streams it to the wandb server (needs network and WANDB_API_KEY); null: $WANDB_MODE, else offline."))
    mlflow_tracking_uri: str | None = Field(None, min_length=1, description=(
        "MLflow tracking store, e.g. 'http://mlflow:5000' or 'sqlite:////abs/mlflow.db'; null: $MLFLOW_TRACKING_URI, "
        "else an SQLite store output_dir/mlflow/mlflow.db with artifacts in output_dir/mlflow/artifacts."))

    @field_validator("trackers")
    @classmethod
    def _each_once(cls, trackers: list[str]) -> list[str]:
        repeated = sorted({t for t in trackers if trackers.count(t) > 1})
        if repeated:
            raise ValueError(f"expected each tracker at most once, got {repeated} more than once in {trackers}")
        return trackers
