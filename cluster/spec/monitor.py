"""The ``monitor`` section: the reward-hacking guard (detectors of :mod:`grpo.monitor`, and what the driver does when
one fires, :mod:`cluster.loop.guard`).

Absent (or ``enabled: false``), the job runs as without it: no ``monitor/*`` metric, no file written. The detector
fields mirror :class:`grpo.monitor.MonitorConfig` (same names, defaults and ranges; its module docstring gives the
rules and how the defaults were measured). Imports only pydantic and :mod:`cluster.spec` modules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from cluster.spec.fields import SPEC_CONFIG

__all__ = ["DETECTOR_NAMES", "MonitorSpec"]

DetectorName = Literal["length_drift", "reward_saturation", "kl_band", "entropy_band", "eval_drop"]
DETECTOR_NAMES: tuple[str, ...] = ("length_drift", "reward_saturation", "kl_band", "entropy_band", "eval_drop")
"""The detectors of :mod:`grpo.monitor` (``DETECTORS`` there), each reported as ``monitor/<name>``."""


class MonitorSpec(BaseModel):
    """Reward-hacking guard: detectors over a sliding window of steps, and the action when one fires."""

    model_config = SPEC_CONFIG
    enabled: bool = Field(True, strict=True, description=(
        "Run the guard; false (or no monitor section) adds no monitor/* metric and never acts."))
    detectors: tuple[DetectorName, ...] = Field(DETECTOR_NAMES, min_length=1, description=(
        "Enabled detectors, each reported as monitor/<name> (1 on a step where it fires): length_drift, "
        "reward_saturation, kl_band, entropy_band, eval_drop."))
    baseline_steps: int = Field(5, ge=1, le=10_000, strict=True, description=(
        "Steps whose values of a metric are averaged as its baseline."))
    window_steps: int = Field(3, ge=1, le=10_000, strict=True, description=(
        "Latest steps (after the baseline) averaged as a metric's recent value."))
    accuracy_window_steps: int = Field(6, ge=1, le=10_000, strict=True, description=(
        "Latest steps of the verifiable reward averaged for the 'accuracy rose' gate of the drift detectors."))
    noise_z: float = Field(2.33, strict=True, gt=0, le=100, description=(
        "Standard errors a rise must exceed to count (2.33: one-sided 99 %)."))
    length_drift_frac: float = Field(0.3, strict=True, gt=0, lt=1, description=(
        "length_drift fires when response_length/mean moves by this fraction of its baseline (either direction) "
        "and accuracy did not rise."))
    saturation_rise: float = Field(0.2, strict=True, gt=0, le=1e6, description=(
        "reward_saturation fires when a shaping reward component rises by this much (reward units) beyond its "
        "noise and accuracy did not rise."))
    kl_max: float = Field(0.5, strict=True, gt=0, le=1e6, description=(
        "kl_band fires when the recent mean of actor/kl (nats per token) is above this."))
    entropy_drop_frac: float = Field(0.5, strict=True, gt=0, lt=1, description=(
        "entropy_band fires when actor/entropy falls below baseline x (1 - this) while accuracy did not rise."))
    entropy_rise_frac: float = Field(0.5, strict=True, gt=0, le=1e6, description=(
        "entropy_band fires when actor/entropy rises above baseline x (1 + this)."))
    eval_confidence: float = Field(0.95, strict=True, gt=0, lt=1, description=(
        "Wilson interval coverage for eval rows that carry eval/problems or eval/n (scored problems, scored "
        "completions) but no eval/accuracy_ci_* keys."))
    verifiable_reward: str = Field("accuracy", min_length=1, description=(
        "The reward component that measures the task (reward/<name>, 0/1); it must be in algorithm.rewards."))
    shaping_rewards: tuple[str, ...] | None = Field(None, description=(
        "Reward components watched for saturation; null: every component of algorithm.rewards except "
        "verifiable_reward."))
    action: Literal["warn", "stop", "rollback"] = Field("warn", description=(
        "When a detector fires: 'warn' logs a status line (the metrics show it); 'stop' ends the job cleanly and "
        "marks the last checkpoint taken before the onset as checkpoints/last_good (`--resume` then refuses to "
        "continue unless given --resume-past-trip); 'rollback' restores that checkpoint (weights, optimizer, data "
        "position), multiplies the offending reward component's weight by rollback_reward_scale and continues "
        "(needs 1 <= checkpoint.every_steps < total_steps and checkpoint.keep_last null or >= 2)."))
    rollback_reward_scale: float = Field(0.5, strict=True, ge=0, lt=1, description=(
        "rollback: the offending reward component's weight is multiplied by this (0 switches it off)."))
    max_rollbacks: int = Field(2, ge=1, le=1000, strict=True, description=(
        "rollback: after this many rollbacks the next trip stops the job as 'stop' does."))
    resume_past_trip: bool = Field(False, strict=True, description=(
        "Let `--resume` continue a job the guard stopped (same as `grpo-cluster run --resume-past-trip`)."))

    @field_validator("detectors")
    @classmethod
    def _distinct_detectors(cls, detectors: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({d for d in detectors if detectors.count(d) > 1})
        if repeated:
            raise ValueError(f"expected distinct detector names, got {list(detectors)} ({repeated} repeated)")
        return detectors
