"""The ``metrics`` section: ``metrics.jsonl``, console lines, the Prometheus endpoint and experiment trackers.

Trackers (``metrics.trackers``) are metric sinks beside ``metrics.jsonl`` and Prometheus (``cluster.sinks.trackers``):
each receives the same per-step rows under the same keys, the spec and git commit as its run configuration, and at
the end of the job the ``plot`` picture and the held-out evaluation table as artifacts. Their files go under
``output_dir`` unless their own settings say otherwise.

Imports only pydantic, :mod:`cluster.spec.fields` and :mod:`cluster.spec.variants` (``metrics.trackers`` is checked
against the tracker registry, ``cluster.sinks.trackers.registry``, when the spec is validated).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from cluster.spec.fields import MAX_COUNT, SPEC_CONFIG, NonEmptyStr
from cluster.spec.variants import TRACKER

__all__ = ["MetricsSpec"]


class MetricsSpec(BaseModel):
    """metrics.jsonl in output_dir, console lines, a Prometheus endpoint and, optionally, experiment trackers."""

    model_config = SPEC_CONFIG
    host: NonEmptyStr = Field("127.0.0.1", description="Address the Prometheus HTTP server binds to.")
    port: int | None = Field(9300, ge=0, le=65535, strict=True, description=(
        "Prometheus port; 0 picks a free one, null disables."))
    log_every_steps: int = Field(1, ge=1, le=MAX_COUNT, strict=True, description=(
        "Print a console line every this many steps."))
    samples_per_step: int = Field(2, ge=0, le=MAX_COUNT, strict=True, description=(
        "Groups of each step written to output_dir/samples.jsonl and to every tracker as a table: prompt, each "
        "completion or episode (turns, tool calls, observations), reward components, advantage, finish reason, "
        "lengths, policy version and staleness, and per token its text, whether it was trained on and the "
        "trainer-vs-engine logprob gap (grpo-cluster report shows them). The first groups of the step, with the "
        "first one whose rewards differ among its completions among them; held-out evaluations write every "
        "problem's result there too. 0: none."))
    sample_max_tokens: int = Field(512, ge=1, le=MAX_COUNT, strict=True, description=(
        "Tokens kept of each completion in samples.jsonl (its text and per-token data; a longer one is cut and "
        "marked) and of each prompt (its last tokens): bounds the file's growth per step."))
    trackers: list[Annotated[str, Field(strict=True), TRACKER.validator]] = Field(
        default_factory=list, description=TRACKER.describe(
            "Experiment trackers that receive every step's metrics (same keys as metrics.jsonl), the spec and git "
            "commit as the run's configuration, and at the end the plot picture and the eval table, each "
            "tracker's sink called in this order. Each needs its library (pip install -e '.[trackers]'); a tracker "
            "that fails warns once and is switched off, training goes on. [] (default): none. Each entry is",
            "wandb (offline by default: files in output_dir/wandb), mlflow (an SQLite store in output_dir/mlflow), "
            "tensorboard (event files in output_dir/tensorboard), trackio (its SQLite database in output_dir/trackio "
            "unless $TRACKIO_DIR is set)"))
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
