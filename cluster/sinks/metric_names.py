"""What a metric key becomes in Prometheus: its gauge name (:func:`prometheus_name`), its ``pool`` label
(:func:`pool_of`), its HELP text (:data:`METRIC_HELP`), and the label names and reserved values every series of
:class:`cluster.sinks.metrics.MetricsLogger` carries.
"""

from __future__ import annotations

import re

LABELS: tuple[str, ...] = ("job", "pool", "worker")
"""Label names of every exported series."""

POOLS: tuple[str, ...] = ("driver", "rollout", "train", "sync")
"""Values of the ``pool`` label of per-worker series (and of the driver's, but for the goodput series of a pool
outside these, e.g. ``reward``: :func:`pool_of`)."""

DRIVER_WORKER = "driver"
"""``worker`` label of the driver's aggregate figures (reserved: no worker may be called this)."""

LAST_STEP_TIMESTAMP_KEY = "last_step_timestamp_seconds"
"""Gauge ``grpo_last_step_timestamp_seconds``: Unix time of the last logged step (of the logger's start before the
first step). ``time() - grpo_last_step_timestamp_seconds`` is how long the job has gone without a step."""

POOL_OF_KEY: tuple[tuple[str, str], ...] = (
    ("rollout/", "rollout"), ("response_length/", "rollout"), ("perf/rollout_", "rollout"),
    ("timing/generate_s", "rollout"),
    ("actor/", "train"), ("perf/train_", "train"), ("timing/train_", "train"), ("memory/train_", "train"),
    ("packing/", "train"),
    ("sync/", "sync"), ("timing/sync_s", "sync"),
)
"""(key prefix, pool): the first prefix a key starts with names its pool; keys matching none belong to ``driver``
(``step``, ``policy_version``, ``reward/*``, ``groups/*``, ``data/*``, ``workers/*``, ``timing/step_s``)."""

_TIME_KEY = re.compile(r"time/([a-z0-9]+)_(?:busy_s|waiting_s|idle_s|workers)$")

METRIC_HELP: dict[str, str] = {
    "step": "Training steps completed by the job.",
    LAST_STEP_TIMESTAMP_KEY: "Unix time (seconds) of the last completed step, or of the job's start before step 1.",
    "policy_version": "Policy version: optimizer updates applied to the policy so far.",
    "reward/mean": "Mean total reward over the step's sampled completions that have one (reward/infra_failed: not).",
    "reward/accuracy": "Mean accuracy reward over the completions it scored (fraction of correct final answers).",
    "reward/none_fraction": "Fraction of the step's completions without a reward (infrastructure failures).",
    "reward/infra_failed": "Completions of the step without a reward (infrastructure failures), left out of the loss.",
    "reward/failed": "Reward evaluations of the step that raised or were lost (completions x functions).",
    "actor/loss": "Policy loss of the step (NaN if non-finite).",
    "actor/kl": "Mean per-token KL(policy || reference policy), estimator algorithm.kl_estimator.",
    "actor/clip_fraction": "Fraction of response tokens whose importance ratio was clipped.",
    "actor/kl_behaviour_current": ("Mean per-token k3 estimate of KL(engine behaviour policy || trainer policy before "
                                   "the step) on the sampled tokens (with a correction on, the one-step-off/async "
                                   "default included, or algorithm.off_policy_correction: none)."),
    "actor/behaviour_ratio_min": "Smallest token importance ratio trainer before the step / engine, over all ranks.",
    "actor/behaviour_ratio_max": "Largest token importance ratio trainer before the step / engine, over all ranks.",
    "actor/behaviour_seq_ratio_min": "Smallest geometric-mean importance ratio trainer / engine of a sequence.",
    "actor/behaviour_seq_ratio_max": "Largest geometric-mean importance ratio trainer / engine of a sequence.",
    "actor/mis_masked_fraction": ("Fraction of valid response tokens that masked importance sampling (algorithm.mis) "
                                  "dropped from the loss."),
    "actor/tis_weight_mean": ("Mean truncated importance weight (algorithm.tis_cap, or the one-step-off/async "
                              "default cap) over the loss tokens."),
    "response_length/mean": "Mean response length, tokens.",
    "perf/rollout_tokens_per_s": "Rollout generation throughput, response tokens per second.",
    "perf/train_tokens_per_s": "Training throughput, tokens per second.",
    "rollout/queue_depth": "Prompt groups queued or in flight at the rollout engine(s).",
    "rollout/kv_cache_usage": "Fraction of the engine's KV cache in use (0..1).",
    "rollout/staleness_max": "Max over trained groups of (policy version trained - policy version that sampled).",
    "rollout/staleness_mean": "Mean over trained groups of (policy version trained - policy version that sampled).",
    "rollout/nonfinite_logprobs": "Trained response tokens whose engine logprob was NaN/inf (importance weight 1).",
    "sync/bytes": "Bytes of weights sent per weight sync.",
    "timing/sync_s": "Wall seconds of the step's weight sync.",
    "workers/restarts": "Worker restarts since the job started (cumulative count).",
    "eval/accuracy": "Held-out pass@1 (mean@k with eval.samples > 1) of the latest evaluation, over what was scored.",
    "eval/accuracy_ci_low": "Lower bound of the held-out accuracy's 95% Wilson interval.",
    "eval/accuracy_ci_high": "Upper bound of the held-out accuracy's 95% Wilson interval.",
    "eval/n": "Completions the latest held-out evaluation scored (the unscored are in eval/unscored, not eval/n).",
    "eval/unscored": "Held-out completions eval.accuracy_reward gave no score; left out of eval/accuracy and eval/n.",
    "eval/dropped": "Held-out rows read but not evaluated (over data.max_prompt_tokens, unreadable, or in training).",
    "eval/best_accuracy": "Best held-out accuracy so far.",
    "monitor/tripped": "1 on a step where a reward-hacking detector of the monitor section fired, else 0.",
    "monitor/rollbacks": "Rollbacks to the last good checkpoint made by the reward-hacking guard so far.",
    "goodput/tokens_per_s": "Trained (loss) tokens of the step per wall second of the step.",
    "goodput/tokens_per_core_s": "Trained (loss) tokens of the step per core-second (wall x cores of the job).",
    "goodput/trained_tokens": "Loss tokens the step's update learned from (0 when it was skipped).",
    "goodput/cores": "CPU cores allotted to the job (its pools' Ray resources; the driver's CPU affinity in-process).",
    "health/warnings": "Health detectors (health section) that warned on the step.",
    **{f"time/{pool}_{part}": f"{what}, worker-seconds of the step ({pool} pool): {how}."
       for pool, what in (("driver", "The loop's main thread"), ("rollout", "Rollout engines"),
                          ("train", "Train ranks"), ("reward", "Reward workers"), ("environment", "Environment slots"),
                          ("agents", "Agent workers"))
       for part, how in (("busy_s", "doing its own work"), ("waiting_s", "held by another pool"),
                         ("idle_s", "with nothing to do"))},
}
"""HELP text of the figures the dashboards and alerts use; other keys get a generic one."""

def prometheus_name(key: str) -> str:
    """``reward/mean`` → ``grpo_reward_mean``: prefix ``grpo_``, characters outside [a-zA-Z0-9_:] → ``_``."""
    return "grpo_" + re.sub(r"[^a-zA-Z0-9_:]", "_", key)


def pool_of(key: str) -> str:
    """The ``pool`` label of a driver-level metric key (see :data:`POOL_OF_KEY`): ``actor/kl`` → ``train``; a
    goodput key ``time/<pool>_{busy_s,waiting_s,idle_s,workers}`` (``cluster.loop.goodput``) is labelled with its own
    pool (``time/reward_busy_s`` → ``reward``), so one selector over every ``grpo_time_*_busy_s`` series keeps
    the pools apart."""
    if (m := _TIME_KEY.match(key)) is not None:
        return m.group(1)
    for prefix, pool in POOL_OF_KEY:
        if key.startswith(prefix):
            return pool
    return "driver"
