"""The train-backend registry (``train_workers.registry``) and the :class:`TrainWorker` protocol.

``train.strategy`` picks the class ``TrainPool`` starts; entries given as ``"module:Class"`` are imported on first
use, so the control plane imports no backend; an unknown name fails naming ``train.strategy`` and the known ones.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from contract.train_worker import TrainWorker
from train_workers.registry import TRAIN_BACKENDS, register_train_backend, train_backend

ROOT = Path(__file__).resolve().parents[2]


def test_fsdp_is_registered_as_a_string_and_resolves_to_the_worker():
    from train_workers.fsdp_worker import FSDPTrainWorker

    assert TRAIN_BACKENDS["fsdp"] == "train_workers.fsdp_worker:FSDPTrainWorker"
    assert train_backend("fsdp") is FSDPTrainWorker
    assert TRAIN_BACKENDS["fsdp"] == "train_workers.fsdp_worker:FSDPTrainWorker"  # resolving leaves the entry as is


def test_unknown_strategy_names_the_field_and_the_known_backends():
    with pytest.raises(ValueError, match=r"train\.strategy 'deepspeed' has no train backend; known: \['fsdp', "
                                         r"'megatron'\]"):
        train_backend("deepspeed")


def test_megatron_is_registered_and_checks_its_layout_before_anything_starts(tmp_path):
    """The registered Megatron class checks a spec's TP × PP layout against ``config.json`` through the registry
    (the driver's route: ``train_backend(strategy).check_layout``), naming the field; megatron-core not needed."""
    import json

    from cluster.spec import TrainSpec

    assert TRAIN_BACKENDS["megatron"] == "train_workers.megatron.worker:MegatronTrainWorker"
    backend = train_backend("megatron")
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1100,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    layout = backend.check_layout(TrainSpec(strategy="megatron", world_size=4, tensor_parallel_size=2), tmp_path)
    assert (layout.tp, layout.pp, layout.padded_vocab_size) == (2, 1, 1280)
    with pytest.raises(ValueError, match=r"train\.tensor_parallel_size: tensor_parallel_size=4 must divide the "
                                         r"model's num_key_value_heads=2"):
        backend.check_layout(TrainSpec(strategy="megatron", world_size=4, tensor_parallel_size=4), tmp_path)
    layout = backend.check_layout(TrainSpec(strategy="megatron", world_size=4, tensor_parallel_size=2,
                                            pipeline_parallel_size=2), tmp_path)
    assert (layout.tp, layout.pp, layout.layers_per_stage) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"train\.pipeline_parallel_size: pipeline_parallel_size=3 must divide the "
                                         r"model's num_hidden_layers=4"):
        backend.check_layout(TrainSpec(strategy="megatron", world_size=3, pipeline_parallel_size=3), tmp_path)
    assert backend.check_layout(TrainSpec(strategy="megatron"), tmp_path, dtype="bfloat16").tp == 1  # mixed precision
    assert backend.check_layout(TrainSpec(strategy="megatron", world_size=2, tensor_parallel_size=2,
                                          sequence_parallel=True), tmp_path).tp == 2
    with pytest.raises(ValueError, match=r"train\.sequence_parallel=true with train\.pipeline_parallel_size > 1"):
        backend.check_layout(TrainSpec(strategy="megatron", world_size=4, tensor_parallel_size=2,
                                       pipeline_parallel_size=2, sequence_parallel=True), tmp_path)
    with pytest.raises(ValueError, match=r"model\.dtype='float16': the megatron backend has no loss scaling"):
        backend.check_layout(TrainSpec(strategy="megatron"), tmp_path, dtype="float16")


def test_duplicate_name_raises(monkeypatch):
    monkeypatch.setattr("train_workers.registry.TRAIN_BACKENDS", dict(TRAIN_BACKENDS))
    from train_workers import registry

    with pytest.raises(ValueError, match="'fsdp' is registered already"):
        register_train_backend("fsdp", object)
    register_train_backend("other", object)
    with pytest.raises(ValueError, match="'other' is registered already"):
        register_train_backend("other", object)
    assert registry.TRAIN_BACKENDS["other"] is object and "other" not in TRAIN_BACKENDS


def test_string_entry_must_name_module_and_class(monkeypatch):
    monkeypatch.setattr("train_workers.registry.TRAIN_BACKENDS", dict(TRAIN_BACKENDS))
    with pytest.raises(ValueError, match=r"expected 'module:Class', got 'no_colon'"):
        register_train_backend("bad", "no_colon")


def test_string_entry_is_imported_on_first_use(monkeypatch, tmp_path):
    (tmp_path / "lazy_train_backend.py").write_text("class Backend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("train_workers.registry.TRAIN_BACKENDS", dict(TRAIN_BACKENDS))
    monkeypatch.delitem(sys.modules, "lazy_train_backend", raising=False)

    register_train_backend("lazy", "lazy_train_backend:Backend")
    assert "lazy_train_backend" not in sys.modules
    cls = train_backend("lazy")
    assert cls.__name__ == "Backend" and cls.__module__ == "lazy_train_backend"
    assert "lazy_train_backend" in sys.modules


def test_the_train_pool_imports_no_backend():
    """Importing the loop's pools leaves the FSDP2 worker unimported (it comes in through the registry)."""
    code = "import sys, cluster.ray_shell.pools; print('train_workers.fsdp_worker' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_backends_satisfy_the_protocol(strategy):
    from cluster.spec import AlgorithmSpec, TrainSpec

    backend = train_backend(strategy)
    worker = backend(0, 1, "unused", TrainSpec(world_size=1, strategy=strategy), AlgorithmSpec(), 1.0, 16)
    assert isinstance(worker, TrainWorker)
    methods = [name for name, member in vars(TrainWorker).items()
               if callable(member) and not name.startswith("_")]
    assert {"train_step", "reference_logprobs", "sync_plan", "broadcast_weights", "save_checkpoint",
            "load_checkpoint", "set_kl_coef", "init_distributed"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(TrainWorker, name)).parameters.values())
        got = list(inspect.signature(getattr(backend, name)).parameters.values())
        assert [p.name for p in got[:len(wanted)]] == [p.name for p in wanted], name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(wanted):]), name


def test_spec_strategy_follows_the_registry(monkeypatch):
    """``train.strategy`` accepts a name once a backend is registered under it, and refuses it (naming the
    registered ones) before."""
    from pydantic import ValidationError

    from cluster.spec import TrainSpec
    from train_workers import registry

    assert TrainSpec(strategy="megatron").strategy == "megatron"
    monkeypatch.delitem(registry.TRAIN_BACKENDS, "megatron")
    with pytest.raises(ValidationError, match=r"unknown train backend 'megatron'; expected one registered in "
                                              r"train_workers\.registry\.TRAIN_BACKENDS: fsdp\."):
        TrainSpec(strategy="megatron")


def test_megatron_refuses_sampling_filters_with_tensor_parallelism():
    """Top-k/top-p/min-p need the whole vocabulary per position: refused at tp > 1 naming the rollout field, accepted
    at tp = 1 (computed as the FSDP2 path does) and when off."""
    from cluster.spec import AlgorithmSpec, TrainSpec

    backend = train_backend("megatron")
    tp2 = TrainSpec(world_size=2, strategy="megatron", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"rollout\.top_k=20: sampling filters are not computed vocab-parallel"):
        backend(0, 2, "unused", tp2, AlgorithmSpec(), 1.0, 16, sampling_filters={"top_k": 20, "top_p": 1.0})
    backend(0, 2, "unused", tp2, AlgorithmSpec(), 1.0, 16, sampling_filters={"top_k": -1, "top_p": 1.0, "min_p": 0.0})
    backend(0, 1, "unused", TrainSpec(world_size=1, strategy="megatron"), AlgorithmSpec(), 1.0, 16,
            sampling_filters={"top_k": 20, "top_p": 0.9})
