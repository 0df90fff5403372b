"""``rollout.mode: async`` in the loop, on the in-process runtime (tiny random Llama, transformers sampling in the
producer thread, one train rank; seconds). (The real engine's async loop, with partial rollouts and pinned cores, is
tests/ray/test_loop_modes.py.)

- max_staleness 2: a producer generates while each step trains, so step 2 trains on version 0's samples at version 1
  and step 3 on samples 1 or 2 versions old (how far the producer got during step 1 depends on timing), never more;
  the checkpoint after step 2 records step 3's queued batch as in flight.
- ``rollout.partial_rollout`` (max_staleness 1): the producer's calls are slowed (:class:`SlowProducerFleet`: a pause
  before every token step of an overlapped call) so that each is still running when the step being trained finishes:
  it is interrupted, carried over and continued on the new weights; every completion interrupted is continued exactly
  once, every prompt of the epoch is trained once, staleness (from each group's oldest token) stays within 1.

Six prompts, two per step: the three steps are exactly one epoch, so every prompt is trained once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.in_process import LocalFleet
from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


class SlowProducerFleet(LocalFleet):
    """A :class:`LocalFleet` whose overlapped (interruptible) calls pause ``delay_s`` before every token step, so that
    a producer call outlasts the train step it overlaps."""

    delay_s = 0.08

    def interrupted(self, interrupt_epoch: int | None) -> bool:
        if interrupt_epoch is not None:
            time.sleep(self.delay_s)
        return super().interrupted(interrupt_epoch)


def _spec(tiny_model_dir, gsm8k_train_path, base: Path, *overrides: str):
    return reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out", "rollout.mode=async",
                          "checkpoint.save_final=false", "metrics.port=null", "name=async", *overrides)


def test_async_loop_trains_within_max_staleness_and_records_versions(tiny_model_dir, gsm8k_train_path,
                                                                     parity_registered, tmp_path):
    """async, max_staleness 2: step 1 on-policy; step 2's batch was queued during step 1 (version 0, trained at 1);
    step 3's during step 1 or 2 (the producer always starts one when there is room, and the sync waits for it), so
    staleness 1 or 2. Nothing dropped (the queue bound keeps every batch within 2 versions); the checkpoint after step
    2 records step 3's queued batch as in flight; each prompt trained once; the audit matches the metrics."""
    from cluster.in_process import local_job

    spec = _spec(tiny_model_dir, gsm8k_train_path, tmp_path, "rollout.max_staleness=2", "checkpoint.every_steps=2")
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert all(m["sync/verified"] is True and m["actor/update_skipped"] == 0.0 for m in history)
    staleness = [m["rollout/staleness_max"] for m in history]
    assert staleness[:2] == [0.0, 1.0] and staleness[2] in (1.0, 2.0), staleness
    assert [m["rollout/stale_dropped"] for m in history] == [0, 0, 0]
    assert history[-1]["rollout/stale_dropped_total"] == 0
    assert [m["rollout/inflight_resampled"] for m in history] == [0, 0, 0]
    rows_per_step = spec.rollout.prompts_per_step * spec.rollout.group_size
    for m, s in zip(history, staleness):
        hist = [m[f"rollout/staleness_hist/{v}"] for v in range(3)]
        assert hist == [rows_per_step if v == s else 0 for v in range(3)], (s, hist)
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert diffs[0] < 2e-5 and all(2e-5 < d < 1e-2 for d in diffs[1:]), diffs
    out = Path(spec.output_dir)
    rows = _rows(out, "trained_prompts.jsonl")
    assert [[r["policy_version"] - 1 - v for v in r["sample_versions"]] for r in rows] == [[s, s] for s in staleness]
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["inflight_groups"] == 2 and state["step"] == 2 and state["sampler"]["offset"] == 4


def test_partial_rollout_loop_trains_every_prompt_once(tiny_model_dir, gsm8k_train_path, parity_registered,
                                                       tmp_path):
    """What step k interrupts, step k+1 continues (restarting none: staleness 1 is allowed); the last step
    interrupts nothing (no producer). The slowed producer is interrupted at steps 1 and 2, so steps 2 and 3 train
    groups whose first tokens are one version older than their last."""
    from cluster.driver import GRPOJob
    from cluster.in_process import LocalTrainer

    spec = _spec(tiny_model_dir, gsm8k_train_path, tmp_path, "rollout.max_staleness=1", "rollout.partial_rollout=true",
                 "rollout.max_response_tokens=64", "checkpoint.every_steps=0")
    job = GRPOJob(spec, fleet=SlowProducerFleet(spec), trainer=LocalTrainer(spec), progress=False)
    with stopped_after(job):
        history = job.run()
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert all(m["sync/verified"] is True and m["actor/update_skipped"] == 0.0 for m in history)
    interrupted = [m["rollout/partial_interrupted"] for m in history]
    resumed = [m["rollout/partial_resumed"] for m in history]
    assert resumed == [0] + interrupted[:-1] and interrupted[-1] == 0
    assert interrupted[0] > 0 and interrupted[1] > 0, interrupted  # the slowed producer outlasts each train step
    assert all(m["rollout/partial_restarted"] == 0 for m in history)
    assert all(m["rollout/staleness_max"] <= 1.0 for m in history)
    assert all(0.0 <= m["rollout/partial_older_token_fraction"] <= 1.0 for m in history)
    assert history[0]["rollout/partial_older_token_fraction"] == 0.0  # step 1 samples on version 0 only
    assert all(m["rollout/partial_older_token_fraction"] > 0.0 for m in history[1:])  # continued on new weights
    rows = _rows(Path(spec.output_dir), "trained_prompts.jsonl")
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]  # one epoch, each prompt once
