"""Checkpoints, exact resume and skipped updates in the loop, on the in-process runtime (``cluster.in_process``: tiny
random Llama, one train rank; seconds). (Moved from tests/ray/test_reliability.py: what the loop does with its
checkpoints and non-finite updates needs neither Ray nor vLLM; killed ranks and engines stay there.)

- The reference: 4 steps over four prompts (two per step: every second step ends an epoch), a checkpoint after every
  step, ``keep_last: 2``.
- Exact resume: the same job run to step 2 and resumed from its step-2 checkpoint (an epoch boundary) to step 4 logs
  the reference's figures and trains its prompts, step by step — nothing lost, nothing repeated.
- ``keep_last`` prunes old checkpoints; a half-written one left by a crash is ignored on resume.
- A non-finite loss skips the update (weights and version unchanged, nothing synced); ``train.max_skipped_updates`` in
  a row stop the job. The loss is poisoned by a train backend registered under a test name
  (:func:`tests.faults.nonfinite_backend`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.job_runs import run_to_end, stopped_after
from tests.reference_job import reference_spec

#: Per-step figures that depend on everything upstream: sampling (seeds, weights), rewards, loss, gradients.
COMPARED = ["policy_version", "reward/mean", "response_length/mean", "actor/kl", "actor/grad_norm",
            "actor/clip_fraction", "data/epoch"]


@pytest.fixture(scope="module")
def make_spec(tiny_model_dir, gsm8k_train_path, parity_registered, tmp_path_factory):
    """``make(name, *overrides)``: 4 steps over the first four GSM8K rows, a checkpoint every step, its own folder."""
    four = tmp_path_factory.mktemp("data") / "four.jsonl"
    with open(gsm8k_train_path) as f:
        four.write_text("".join(next(f) for _ in range(4)))

    def make(name: str, *overrides: str):
        return reference_spec(tiny_model_dir, four, tmp_path_factory.mktemp(name), "total_steps=4",
                              "checkpoint.every_steps=1", "metrics.port=null", f"name={name}", *overrides)
    return make


def _trained_prompts(spec) -> list[list[int]]:
    rows = [json.loads(ln) for ln in (Path(spec.output_dir) / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return [r["prompts"] for r in rows]


def _metrics(spec) -> list[dict]:
    from cluster.sinks.metrics import read_metrics_jsonl

    rows = read_metrics_jsonl(Path(spec.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "a step recorded twice or missing"
    return rows


@pytest.fixture(scope="module")
def reference(make_spec):
    """The uninterrupted 4-step run (keeps the last 2 checkpoints)."""
    from cluster.in_process import local_job

    spec = make_spec("reference", "checkpoint.keep_last=2")
    run_to_end(local_job(spec, progress=False))
    prompts = _trained_prompts(spec)
    assert sorted(prompts[0] + prompts[1]) == [0, 1, 2, 3] == sorted(prompts[2] + prompts[3])  # two whole epochs
    return spec


def test_resume_from_an_epoch_boundary_repeats_the_reference_exactly(make_spec, reference):
    from cluster.in_process import local_job

    spec = make_spec("resumed")
    first = spec.model_copy(update={"total_steps": 2})
    run_to_end(local_job(first, progress=False))
    assert len(_metrics(spec)) == 2
    with stopped_after(local_job(spec, progress=False, resume=True)) as job:
        assert job.step == 2 and job.policy_version == 2
        assert job.resume_from == Path(spec.output_dir) / "checkpoints" / "step_000002"
        job.run()
    got, ref = _metrics(spec), _metrics(reference)
    assert len(got) == len(ref) == 4
    for g, r in zip(got, ref):
        for key in COMPARED:
            assert g[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), f"step {g['step']} {key}"
    assert _trained_prompts(spec) == _trained_prompts(reference)


def test_partial_checkpoint_ignored_and_keep_last(reference):
    """The reference run saved steps 1-4 with ``keep_last=2``; a crash mid-write of step 5 is then simulated."""
    from cluster.in_process import local_job
    from cluster.loop.checkpoints import latest_checkpoint

    root = Path(reference.output_dir) / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    # A crash while writing step 5: the temporary folder has weights but no trainer_state.json.
    partial = root / "step_000005.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    assert latest_checkpoint(root) == root / "step_000004"
    resumed = local_job(reference, progress=False, resume=True)
    assert resumed.step == 4 and resumed.resume_from == root / "step_000004"
    resumed.close()


def test_nan_updates_skipped_then_stop(make_spec):
    """A NaN loss skips the update (weights and version unchanged, nothing synced); K in a row stop the job."""
    from cluster.driver import GRPOJob
    from cluster.in_process import LocalFleet, LocalTrainer
    from cluster.loop.training import NumericsError
    from tests.faults import nonfinite_backend
    from tests.registered import variant_registered
    from train_workers.registry import TRAIN_BACKENDS, register_train_backend

    backend = nonfinite_backend({2, 3})  # the rank's 2nd and 3rd train steps: steps 2 and 3
    with variant_registered(TRAIN_BACKENDS, "fsdp_nonfinite",
                            lambda: register_train_backend("fsdp_nonfinite", backend)):
        spec = make_spec("nan", "train.strategy=fsdp_nonfinite", "train.max_skipped_updates=2", "total_steps=3")
        fleet = LocalFleet(spec)
        with stopped_after(GRPOJob(spec, fleet=fleet, trainer=LocalTrainer(spec), progress=False)) as job:
            with pytest.raises(NumericsError, match=r"step 3: 2 updates in a row skipped for a non-finite actor/loss"):
                job.run()
            assert job.policy_version == 1 and job.versions.engine_versions == [1] and fleet.model_version == 1
    rows = _metrics(spec)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/update_skipped"] == 0.0 and rows[0]["policy_version"] == 1
    assert rows[1]["actor/update_skipped"] == 1.0 and rows[1]["policy_version"] == 1
    assert rows[1]["sync/skipped"] == 1.0 and rows[1]["actor/updates_skipped_total"] == 1
