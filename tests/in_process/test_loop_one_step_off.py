"""``rollout.mode: one_step_off`` in the loop, on the in-process runtime (``cluster.in_process.local_job``: tiny random
Llama, transformers sampling in the producer thread, one train rank; seconds): the batch of step k+1 is generated
while step k trains, so every batch after the first is trained one policy version after the one that sampled it; then
a resume from the step-2 checkpoint, taken while step 3's batch was in flight, samples that batch's prompts again:
none lost, none trained twice. (The real engine's one_step_off loop is tests/ray/test_loop_modes.py.)

Six prompts, two per step: the three steps are exactly one epoch, so every prompt is trained once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def one_step_off_run(tiny_model_dir, gsm8k_train_path, parity_registered, tmp_path_factory):
    """Run 3 one_step_off steps (checkpoint after step 2 only); returns (spec, history)."""
    from cluster.in_process import local_job

    base = tmp_path_factory.mktemp("one_step_off")
    spec = reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out",
                          "rollout.mode=one_step_off", "rollout.max_staleness=1", "checkpoint.every_steps=2",
                          "checkpoint.save_final=false", "metrics.port=null", "name=one_step_off")
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
    return spec, history


def test_one_step_off_trains_on_batches_one_version_old(one_step_off_run):
    spec, history = one_step_off_run
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert all(m["sync/verified"] is True and m["actor/update_skipped"] == 0.0 for m in history)
    # step 1 has nothing prefetched (sampled by version 0, trained from 0); steps 2 and 3 train from v on v-1's samples
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0]
    assert [m["rollout/staleness_mean"] for m in history] == [0.0, 1.0, 1.0]
    assert [m["rollout/sample_policy_version_min"] for m in history] == [0, 0, 1]
    assert [m["rollout/inflight_resampled"] for m in history] == [0, 0, 0]
    assert [m["rollout/prefetch_deferred"] for m in history] == [0.0, 0.0, 0.0]
    # Step 1 samples with the trainer's own weights; steps 2 and 3 compare the fleet's logprobs under v-1 with the
    # trainer's under v: one update apart, far from 0 (the batch really is stale) yet small (the fleet got version
    # v-1 exactly: the verified sync of the step before).
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert diffs[0] < 2e-5 and all(2e-5 < d < 1e-2 for d in diffs[1:]), diffs
    rows = _rows(Path(spec.output_dir), "trained_prompts.jsonl")
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [1, 1]]  # the audit: version of each group
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]  # one epoch, each prompt once


def test_one_step_off_resume_resamples_the_inflight_batch(one_step_off_run, tmp_path):
    """Resume from the step-2 checkpoint (written while step 3's batch was prefetched): step 3 draws the same prompts
    again from the recorded position, samples them on version 2 (staleness 0: nothing was prefetched) and counts them
    in rollout/inflight_resampled; over the two runs each prompt is trained exactly once."""
    from cluster.in_process import local_job

    spec, history = one_step_off_run
    first = Path(spec.output_dir)
    state = json.loads((first / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["inflight_groups"] == 2 and state["step"] == 2
    out = tmp_path / "resumed"
    shutil.copytree(first, out)
    resumed_spec = spec.model_copy(update={"output_dir": str(out)})
    with stopped_after(local_job(resumed_spec, progress=False, resume=True)) as job:
        assert job.step == 2 and job.policy_version == 2
        resumed = job.run()
    assert [m["policy_version"] for m in resumed] == [3]
    m = resumed[0]
    assert m["rollout/inflight_resampled"] == 2 and m["rollout/staleness_max"] == 0.0
    assert m["rollout/sample_policy_version_min"] == 2 and m["rollout/logprob_diff"] < 2e-5
    rows = _rows(out, "trained_prompts.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    original = _rows(first, "trained_prompts.jsonl")
    assert rows[2]["prompts"] == original[2]["prompts"] and rows[2]["sample_versions"] == [2, 2]
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]
