"""Weight-sync integrity and naming: the rotating verify sample, the spec's verify/mode fields, checksum mismatch
messages, and the trainer's tensor names (HF checkpoint names, tied LM head sent once)."""

from __future__ import annotations

import pytest
import torch

from weight_sync.verify import checked_names

NAMES = [f"t{i}" for i in range(10)]


def test_verify_true_false():
    assert checked_names(NAMES, 3, True, 4) == NAMES
    assert checked_names(NAMES, 3, False, 4) == []


def test_sample_rotates_and_checks_everything_every_k_versions():
    k = 4
    assert checked_names(NAMES, 0, "sample", k) == NAMES and checked_names(NAMES, 8, "sample", k) == NAMES
    assert checked_names(NAMES, 1, "sample", k) == ["t1", "t5", "t9"]
    assert checked_names(NAMES, 2, "sample", k) == ["t2", "t6"]
    assert checked_names(NAMES, 7, "sample", k) == ["t3", "t7"]
    assert checked_names(NAMES, 5, "sample", k) == checked_names(NAMES, 1, "sample", k)  # deterministic
    for start in range(1, 9):  # any k consecutive versions together check every tensor
        window = set().union(*(checked_names(NAMES, v, "sample", k) for v in range(start, start + k)))
        assert window == set(NAMES)
    assert checked_names(NAMES, 3, "sample", 1) == NAMES  # K = 1: always full


def test_sample_bad_arguments():
    with pytest.raises(ValueError, match="sync.verify must be true, false or 'sample', got 'some'"):
        checked_names(NAMES, 1, "some", 4)
    with pytest.raises(ValueError, match="verify_full_every must be >= 1, got 0"):
        checked_names(NAMES, 1, "sample", 0)


def test_spec_sync_fields():
    from pydantic import ValidationError

    from cluster.spec import SyncSpec

    assert SyncSpec().verify is True and SyncSpec().mode == "broadcast" and SyncSpec().verify_full_every == 10
    assert SyncSpec(verify="sample", verify_full_every=3, mode="auto").verify == "sample"
    assert SyncSpec(verify=False).verify is False
    for bad in ({"verify": "sampel"}, {"mode": "shm"}, {"verify_full_every": 0}, {"timeout_s": 0}):
        with pytest.raises(ValidationError):
            SyncSpec(**bad)


def test_checksum_mismatch_names_tensor_engine_and_both_checksums():
    from weight_sync.verify import SyncVerificationError, compare_checksums

    compare_checksums({"a": 1, "b": 2}, {"a": 1, "b": 2}, "engine 0 worker 0")
    compare_checksums({}, {}, "engine 0 worker 0")  # nothing checked: nothing to differ
    with pytest.raises(SyncVerificationError,
                       match=r"engine 1 worker 0: tensor b checksum mismatch: trainer crc32 0x00000002, "
                             r"engine crc32 0x00000003"):
        compare_checksums({"a": 1, "b": 2}, {"a": 1, "b": 3}, "engine 1 worker 0")
    with pytest.raises(SyncVerificationError, match=r"engine 0 worker 1: received tensor set differs: "
                                                    r"missing \['b'\], extra \['c'\]"):
        compare_checksums({"a": 1, "b": 2}, {"a": 1, "c": 2}, "engine 0 worker 1")
    with pytest.raises(SyncVerificationError, match=r"missing \[\], extra \['c'\]"):
        compare_checksums({"a": 1}, {"a": 1, "c": 2}, "engine 0 worker 0")


def test_weight_sync_imports_nothing_from_cluster():
    """``weight_sync/`` is the transport only: importing it pulls in no ``cluster`` module (a fresh interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, weight_sync, weight_sync.transport, weight_sync.verify, weight_sync.buckets, "
            "weight_sync.group, weight_sync.sender\n"
            "print(sorted(m for m in sys.modules if m == 'cluster' or m.startswith('cluster.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]"


def test_trainer_sends_checkpoint_names_with_the_tied_head_once(tmp_path):
    """The plan's names are exactly the HF checkpoint's tensor names (what vLLM's ``load_weights`` maps onto its
    fused qkv/gate_up parameters); the tied LM head is not sent (the engine re-derives it from the embedding)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_model import TINY_CONFIG
    from train_workers.fsdp_sync import FSDPSyncSource
    from train_workers.policy import ResponseLogprobModel
    from train_workers.weight_sender import WeightSender

    config = AutoConfig.for_model("llama", vocab_size=512, **TINY_CONFIG)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        checkpoint_names = set(f.keys())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    # the FSDP2 worker's sync source and sender, without a process group: only the naming is under test
    source = FSDPSyncSource(ResponseLogprobModel(hf, 1.0))
    names = [n for n, _ in source.named_parameters()]
    assert len(names) == len(set(names))
    assert set(names) == checkpoint_names
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    plan = WeightSender(0, torch.device("cpu"), use_cuda=False, source=source).plan("bfloat16", 64 * 1024)
    assert [s.name for b in plan for s in b.slots] == names
    assert all(s.dtype == "bfloat16" for b in plan for s in b.slots)
