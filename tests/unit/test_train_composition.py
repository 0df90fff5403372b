"""The train backends are composed, not inherited (docs/architecture.md, STYLE.md rule 14), read from source with ast
and from the classes themselves; megatron-core is not needed (its imports are inside the methods).

1. No class under ``train_workers/`` derives from a class defined under ``train_workers/``: a backend holds the
   backend-neutral parts (``GRPOStep``, ``WeightSender``, ``RankContext``) as attributes.
2. Each backend's engine and sync source has every member of the protocol it is composed through
   (``StepEngine``, ``SyncSource``), and both workers have every ``TrainWorker`` method.
3. ``pin_to_cores`` is written once (``contract.affinity``); the train ranks and the engines use that function, and
   each keeps its own error message.
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _classes_and_bases() -> list[tuple[str, str, list[str]]]:
    """(file, class name, base names as written) of every class defined under train_workers/."""
    found = []
    for path in sorted((ROOT / "train_workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.append((path.relative_to(ROOT).as_posix(), node.name, [ast.unparse(b) for b in node.bases]))
    return found


def test_no_train_workers_class_inherits_another():
    classes = _classes_and_bases()
    own = {name for _, name, _ in classes}
    assert {"GRPOStep", "FSDPEngine", "MegatronEngine", "WeightSender", "RankContext"} <= own, sorted(own)
    inherited = [f"{f}: {name}({', '.join(bases)})" for f, name, bases in classes
                 if any(b.split(".")[-1] in own for b in bases)]
    assert not inherited, "train_workers classes that inherit a train_workers class:\n" + "\n".join(inherited)


def _members(protocol: type) -> set[str]:
    """The public methods, properties and annotated attributes a protocol declares."""
    names = {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names | set(getattr(protocol, "__annotations__", {}))


def test_engines_sources_and_workers_have_their_protocols_members():
    from contract.train_worker import TrainWorker
    from train_workers.fsdp_engine import FSDPEngine
    from train_workers.fsdp_sync import FSDPSyncSource
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.megatron.engine import MegatronEngine
    from train_workers.megatron.pipeline import MegatronPipeline
    from train_workers.megatron.sync import MegatronSyncSource
    from train_workers.megatron.worker import MegatronTrainWorker
    from train_workers.step_engine import PipelineSchedule, StepEngine
    from train_workers.weight_sender import SyncSource

    engine_members = _members(StepEngine)
    assert {"pipeline", "has_reference", "clip_gradients", "all_reduce_sum"} <= engine_members, engine_members
    for cls, protocol in ((FSDPEngine, StepEngine), (MegatronEngine, StepEngine), (MegatronPipeline, PipelineSchedule),
                          (FSDPSyncSource, SyncSource), (MegatronSyncSource, SyncSource)):
        # ``pipeline`` is an instance attribute of MegatronEngine: look for it in __init__'s assignments
        missing = [m for m in _members(protocol) if not hasattr(cls, m) and f"self.{m} =" not in inspect.getsource(cls)]
        assert not missing, f"{cls.__name__} lacks {protocol.__name__} members {missing}"
    for worker in (FSDPTrainWorker, MegatronTrainWorker):
        missing = [m for m in _members(TrainWorker) if m != "policy_version" and not callable(getattr(worker, m, None))]
        assert not missing, f"{worker.__name__} lacks TrainWorker methods {missing}"
        params = list(inspect.signature(worker.__init__).parameters)[1:]
        assert params == ["rank", "world_size", "model_path", "train", "algorithm", "temperature",
                          "max_response_tokens", "dtype", "seed", "sampling_filters", "model_source"], params


@pytest.fixture
def restore_affinity():
    """Put back this process's CPU cores after a test that may change them."""
    cores = os.sched_getaffinity(0)
    yield sorted(cores)
    os.sched_setaffinity(0, cores)


def test_pin_to_cores_is_written_once_and_keeps_each_callers_message(restore_affinity):
    from contract import affinity
    from rollout_workers.vllm import engine
    from train_workers import cpu_affinity

    assert cpu_affinity.pin_to_cores is affinity.pin_to_cores and engine.pin_to_cores is affinity.pin_to_cores
    defined = [p.relative_to(ROOT).as_posix() for pkg in ("contract", "rollout_workers", "train_workers")
               for p in (ROOT / pkg).rglob("*.py") if "def pin_to_cores(" in p.read_text(encoding="utf-8")]
    assert defined == ["contract/affinity.py"], defined
    allowed = restore_affinity
    absent = max(allowed) + 1
    with pytest.raises(ValueError) as train_error:
        affinity.pin_to_cores([absent], "train.cpu_affinity")
    assert train_error.value.args[0].endswith(f"expected ids among the cores it may use, {allowed}, got [{absent}]")
    with pytest.raises(ValueError) as engine_error:
        affinity.pin_to_cores([absent], "rollout.cpu_affinity", engine.core_ranges)
    assert engine_error.value.args[0].endswith(
        f"expected ids among the cores it may use, {engine.core_ranges(allowed)}, got [{absent}]")
    source = inspect.getsource(engine.VLLMEngine)
    assert 'pin_to_cores(rollout.cpu_affinity, "rollout.cpu_affinity", core_ranges)' in source
