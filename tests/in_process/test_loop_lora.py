"""The loop with a LoRA policy (``train.lora``, issue 16) on the in-process runtime (tiny random Llama, one train rank,
the fleet's own policy copy; seconds): two steps with ``sync: merged``, the same two with ``sync: adapter`` and a
resume from the adapter run's LoRA checkpoint. (Moved from tests/ray/test_lora_loop.py, whose adapter-mode run
into a vLLM engine stays there.)

What it shows: every sync is verified and the fleet's logprobs equal the trainer's recomputation
(``rollout/logprob_diff``), so the policy the fleet samples with — merged weights, or base weights plus the streamed
adapters — is the trainer's; only the adapter tensors are streamed with ``sync: adapter`` (sync/bytes 65,536 vs
12,879,104 merged, measured); the ``actor/trainable_*`` and per-rank memory metrics appear; the checkpoint is a PEFT
adapter folder; a resume loads the adapters and optimizer from it, and the fleet, started from the base weights,
receives the checkpoint's adapters before it samples (its step-3 logprobs equal the trainer's).

The lr (1e-3) makes the adapters move the policy far more than the diff bound: a fleet left on the base weights
would differ from the trainer by much more than 2e-5 per token.
"""

from __future__ import annotations

import json

import pytest

from tests.job_runs import run_to_end
from tests.reference_job import reference_spec, six_prompts

LORA = ["train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3", "checkpoint.every_steps=1", "total_steps=2",
        "metrics.port=null"]


def _run(tiny_model_dir, data, out, *overrides, resume: bool = False) -> list[dict]:
    from cluster.in_process import local_job

    spec = reference_spec(tiny_model_dir, data, out, *LORA, *overrides)
    return run_to_end(local_job(spec, progress=False, resume=resume))


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, gsm8k_train_path, parity_registered, tmp_path_factory):
    """Two steps merged; two steps adapter then a resume to step 3: {"merged", "adapter", "resumed", "out"}."""
    base = tmp_path_factory.mktemp("lora")
    data = six_prompts(gsm8k_train_path, base)
    merged = _run(tiny_model_dir, data, base / "merged", "name=tiny_lora")
    adapter = _run(tiny_model_dir, data, base / "adapter", "train.lora.sync=adapter", "name=tiny_lora_adapter")
    resumed = _run(tiny_model_dir, data, base / "adapter", "train.lora.sync=adapter", "name=tiny_lora_adapter",
                   "total_steps=3", resume=True)
    return {"merged": merged, "adapter": adapter, "resumed": resumed, "out": base}


def test_lora_loop_syncs_verified_merged_weights_and_fleet_matches_trainer(lora_runs):
    history = lora_runs["merged"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["actor/trainable_parameters"] > 0 and 0 < m["actor/trainable_fraction"] < 0.05
        assert m["memory/train_rank0_peak_rss_gib"] > 0  # one rank in process
        assert m["sync/bytes"] == history[0]["sync/bytes"] > 12e6  # merged: the full float32 model every sync
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert history[1]["actor/kl"] > 0


def test_lora_checkpoint_is_an_adapter_folder(lora_runs, tiny_model_dir):
    ckpt = lora_runs["out"] / "merged" / "checkpoints" / "step_000002"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == tiny_model_dir
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer" / "state.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["policy_version"] == 2


def test_lora_adapter_sync_streams_adapters_only_and_resumes(lora_runs):
    history = lora_runs["adapter"] + lora_runs["resumed"]
    merged = lora_runs["merged"]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["sync/bytes"] == history[0]["sync/bytes"] < merged[0]["sync/bytes"] / 100
        assert m["actor/trainable_parameters"] == merged[0]["actor/trainable_parameters"]
    # lora_A/lora_B of 2 layers x 7 linear layers, rank 8, float32, each slot aligned to 64 bytes
    assert 16384 * 4 <= history[0]["sync/bytes"] <= 16384 * 4 + 28 * 64
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert history[1]["actor/kl"] > 0
