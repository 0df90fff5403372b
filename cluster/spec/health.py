"""The ``health`` section: detectors that warn without stopping the job (``cluster.loop.health``).

Each detector watches one kind of trouble and has a threshold field here; null turns that detector off, and
``enabled: false`` turns them all off. A warning names the detector, its value and its threshold on the console, sets
``health/<detector>`` to 1 on the step's row of ``metrics.jsonl`` and Prometheus, and never stops the job (the
``monitor`` section's guard is what stops or rolls back). The defaults give no warning on the measured healthy runs
(the demo, ``examples/learn_cpu.yaml``, ``examples/tool_calc_cpu.yaml``: docs/results.md, "Goodput and
health on the demo").

Imports only pydantic and :mod:`cluster.spec.fields`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from cluster.spec.fields import MAX_COUNT, SPEC_CONFIG, unused_when_off

__all__ = ["HealthSpec"]


class HealthSpec(BaseModel):
    """Health warnings: repetition loops and garbled text in completions, stalled steps, runs of steps without a
    learning signal, KL and entropy jumps, infrastructure failures and engine aborts; each warns (console,
    metrics.jsonl health/<detector>, Prometheus) and never stops the job."""

    model_config = SPEC_CONFIG
    enabled: bool = Field(True, strict=True, description=(
        "Run the detectors; false adds no health/* metric and never warns."))
    repetition_max_fraction: float | None = Field(0.25, strict=True, gt=0, le=1, description=(
        "repetition warns when more than this fraction of the step's sampled completions end in a repetition loop "
        "(their last tokens are one block of at most 64 tokens repeated at least repetition_min_repeats times, "
        "covering at least repetition_min_tokens tokens); null: off."))
    repetition_min_repeats: int = Field(4, ge=2, le=MAX_COUNT, strict=True, description=(
        "Repeats of a block at the end of a completion that make a repetition loop."))
    repetition_min_tokens: int = Field(32, ge=1, le=MAX_COUNT, strict=True, description=(
        "Tokens a repetition loop covers at least (shorter repeats, e.g. a few newlines, are no loop)."))
    garbled_max_fraction: float | None = Field(0.1, strict=True, gt=0, le=1, description=(
        "garbled warns when more than this fraction of the step's sampled completions hold garbled text: at least "
        "garbled_min_chars characters that no healthy text holds (U+FFFD replacement characters left by a broken "
        "UTF-8 sequence, control characters other than tab and line breaks, private-use, unassigned or surrogate "
        "code points); null: off."))
    garbled_min_chars: int = Field(2, ge=1, le=MAX_COUNT, strict=True, description=(
        "Garbled characters that make a completion garbled (one U+FFFD can be a multi-byte character cut at the "
        "length cap)."))
    stall_factor: float | None = Field(3.0, strict=True, gt=1, le=1e6, description=(
        "stall warns when timing/step_s is more than this multiple of the median step time of the earlier steps "
        "(the last 100 at most; from the (stall_min_steps + 1)-th step this job ran); null: off."))
    stall_min_steps: int = Field(3, ge=1, le=MAX_COUNT, strict=True, description=(
        "Earlier steps the stall detector needs before it judges one."))
    flat_run_steps: int | None = Field(4, ge=1, le=MAX_COUNT, strict=True, description=(
        "flat_run warns when this many steps in a row had no learning signal: every sampled group all-flat "
        "(groups/all_equal_fraction = 1, equal rewards, zero advantages); null: off."))
    kl_jump_factor: float | None = Field(4.0, strict=True, gt=1, le=1e6, description=(
        "kl_jump warns when actor/kl is more than this multiple of its median over the previous jump_window_steps "
        "steps and at least kl_jump_min_nats above it; null: off."))
    kl_jump_min_nats: float = Field(0.25, strict=True, ge=0, le=1e6, description=(
        "Least rise of actor/kl (nats per token) above its recent median that counts as a jump."))
    entropy_jump_frac: float | None = Field(0.5, strict=True, gt=0, le=1e6, description=(
        "entropy_jump warns when actor/entropy moves (up or down) by more than this fraction of its median over "
        "the previous jump_window_steps steps and by at least entropy_jump_min_nats; null: off."))
    entropy_jump_min_nats: float = Field(0.5, strict=True, ge=0, le=1e6, description=(
        "Least move of actor/entropy (nats per token) away from its recent median that counts as a jump (a policy "
        "that grows sure of a solved task halves a small entropy in a few steps: 0.45 -> 0.2 nats in "
        "examples/tool_calc_cpu.yaml's run)."))
    jump_window_steps: int = Field(5, ge=1, le=MAX_COUNT, strict=True, description=(
        "Previous steps whose median the KL and entropy jumps are measured from (judged once there are that many)."))
    infra_failed_max_fraction: float | None = Field(0.02, strict=True, ge=0, lt=1, description=(
        "infra_failures warns when more than this fraction of the step's sampled completions got no reward for an "
        "infrastructure failure (reward/infra_failed: a lost reward call, an environment that failed); null: off. "
        "algorithm.max_infra_failed_fraction is the rate that stops the job."))
    engine_aborts_max: int | None = Field(0, ge=0, le=MAX_COUNT, strict=True, description=(
        "engine_aborts warns when more than this many of the step's completions came back aborted by an engine "
        "(finish reason 'abort'; partial rollouts' interruptions are not aborts) plus engines replaced during the "
        "step (workers/restarts); null: off."))

    @model_validator(mode="after")
    def _thresholds_need_enabled(self) -> HealthSpec:
        if not self.enabled:
            unused_when_off(self, tuple(name for name in type(self).model_fields if name != "enabled"), "health",
                            "health.enabled: true")
        return self
