"""The rollout side's seam (issue 36, item 1): a ``RolloutEngine`` protocol in ``contract``, engines picked from
``rollout_workers.registry`` by ``rollout.engine``, vLLM confined to its folder, and one staleness gate for both
fleets. No engine is started here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cluster.spec import SpecError, load_spec_text
from contract.errors import RecoveryDeferred, StaleSamplesError
from contract.figures import FleetFigures
from contract.messages import GroupResult, PoolGenerateStats
from contract.rollout_engine import RolloutEngine
from contract.staleness import StalenessGate
from contract.versions import PolicyVersionLedger
from rollout_workers.registry import ROLLOUT_ENGINES, register_rollout_engine, rollout_engine
from tests.registered import variant_registered

ROOT = Path(__file__).resolve().parents[2]
SPEC = "output_dir: runs/test\ntotal_steps: 1\ndata:\n  train_path: train.jsonl\n"
PROTOCOL_METHODS = ("lora_adapter_problem", "ready", "generate", "interrupt", "init_weight_sync",
                    "close_weight_sync", "receive_weights", "submit", "serve", "busy_seconds", "shutdown")


def test_rollout_engine_registry_holds_vllm_and_hf_by_name_and_vllm_is_the_default():
    assert ROLLOUT_ENGINES == {"vllm": "rollout_workers.vllm.engine:VLLMEngine",
                               "hf": "rollout_workers.hf.engine:HFEngine"}
    assert load_spec_text(SPEC).rollout.engine == "vllm"
    assert load_spec_text(SPEC, overrides=["rollout.engine=hf"]).rollout.engine == "hf"
    assert rollout_engine("hf").__name__ == "HFEngine" and rollout_engine("vllm").__name__ == "VLLMEngine"
    with pytest.raises(ValueError, match=r"rollout.engine 'sglang' has no rollout engine; known: \['hf', 'vllm'\]"):
        rollout_engine("sglang")


@pytest.mark.parametrize("name", sorted(ROLLOUT_ENGINES))
def test_rollout_engine_classes_implement_the_protocol(name):
    cls = rollout_engine(name)
    for method in PROTOCOL_METHODS:
        assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks RolloutEngine.{method}"
    assert cls.lora_adapter_problem(["LlamaForCausalLM"]) is None  # both serve adapters for Llama
    protocol = {n for n in vars(RolloutEngine) if not n.startswith("_")} - {"policy_version"}
    assert protocol == set(PROTOCOL_METHODS)


def test_rollout_engine_registration_adds_a_name_the_spec_accepts_and_refuses_duplicates():
    with variant_registered(ROLLOUT_ENGINES, "test_engine",
                            lambda: register_rollout_engine("test_engine", "rollout_workers.hf.engine:HFEngine")):
        assert load_spec_text(SPEC, overrides=["rollout.engine=test_engine"]).rollout.engine == "test_engine"
        with pytest.raises(ValueError, match="registered already"):
            register_rollout_engine("test_engine", "rollout_workers.hf.engine:HFEngine")
    with pytest.raises(ValueError, match=r"expected 'module:Class'"):
        register_rollout_engine("broken", "rollout_workers.hf.engine")
    assert "broken" not in ROLLOUT_ENGINES


def test_rollout_engine_hf_refuses_tensor_parallelism_naming_the_field():
    with pytest.raises(SpecError, match=r"rollout.tensor_parallel_size: the hf engine runs its model in one process"):
        load_spec_text(SPEC, overrides=["rollout.engine=hf", "rollout.tensor_parallel_size=2"])


def test_rollout_engine_registry_and_spec_import_no_engine():
    """Validating a spec reads the registry's names only: neither engine, nor vLLM, nor transformers is imported."""
    spec = "output_dir: o\\ntotal_steps: 1\\ndata: {train_path: t.jsonl}\\nrollout: {engine: hf}\\n"
    code = (f"import sys\nfrom cluster.spec import load_spec_text\nload_spec_text('{spec}')\n"
            "print(sorted(m for m in ('vllm', 'rollout_workers.vllm.engine', 'rollout_workers.hf.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- one staleness gate --------------------------------------------------------------------------------------------


def _groups(version: int) -> tuple[list[GroupResult], PoolGenerateStats]:
    groups = [GroupResult(g, [1], [[2]], [torch.zeros(1)], ["stop"], ["x"], version) for g in range(2)]
    return groups, PoolGenerateStats(tokens=2, engine_seconds=[1.0], engine_idle_fraction=0.25, per_engine=[])


def _gate(trainer: int, max_staleness: int = 0):
    versions, log = PolicyVersionLedger(trainer), SimpleNamespace(resyncs=[], status=[])
    gate = StalenessGate(versions, max_staleness, log.resyncs.append, log.status.append)
    return gate, log


def test_rollout_engine_staleness_gate_refuses_stale_groups_resyncs_and_samples_again():
    gate, log = _gate(trainer=3)
    figures, answers = FleetFigures(), iter([_groups(2), _groups(3)])
    groups = gate.run(lambda: next(answers), figures=lambda: figures, record=True, recover=True, attempts=3)
    assert [g.policy_version for g in groups] == [3, 3] and log.resyncs == ["stale samples"]
    assert figures.stale_refused == 2 and figures.idle_fractions == [0.25] and figures.tokens == 2
    assert "2 group(s) sampled at policy version 2 (trainer 3, rollout.max_staleness=0)" in log.status[0]


def test_rollout_engine_staleness_gate_defers_without_recovery_and_gives_up_after_its_attempts():
    gate, log = _gate(trainer=3)
    with pytest.raises(RecoveryDeferred, match="2 stale group"):
        gate.run(lambda: _groups(1), figures=FleetFigures, record=True, recover=False, attempts=3)
    with pytest.raises(StaleSamplesError, match=r"after 2 attempts \(trainer at policy version 3"):
        gate.run(lambda: _groups(1), figures=FleetFigures, record=True, recover=True, attempts=2)
    assert log.resyncs == ["stale samples"] * 2


def test_rollout_engine_staleness_gate_hands_engine_faults_to_the_fleet():
    gate, _ = _gate(trainer=0)
    calls = iter([RuntimeError("engine died"), _groups(0)])

    def sample():
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    seen = []
    groups = gate.run(sample, figures=FleetFigures, record=False, recover=True, attempts=3, faults=(RuntimeError,),
                      on_fault=lambda exc: seen.append(str(exc)) or True)
    assert len(groups) == 2 and seen == ["engine died"]
    with pytest.raises(RuntimeError, match="not recovered"):
        gate.run(lambda: (_ for _ in ()).throw(RuntimeError("not recovered")), figures=FleetFigures, record=False,
                 recover=True, attempts=3, faults=(RuntimeError,), on_fault=lambda exc: False)


def test_rollout_engine_one_staleness_gate_for_every_fleet():
    """One ``StaleSamplesError`` class in the project (``contract.errors``), one retry loop (``contract.staleness``),
    and both runtimes' fleets run their generate through it."""
    defined = []
    for package in ("contract", "cluster", "rollout_workers", "train_workers", "weight_sync", "grpo"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            defined += [f"{path.relative_to(ROOT)}:{node.name}" for node in ast.walk(tree)
                        if isinstance(node, ast.ClassDef) and node.name in ("StaleSamplesError", "StalenessGate")]
    assert sorted(defined) == ["contract/errors.py:StaleSamplesError", "contract/staleness.py:StalenessGate"]
    for fleet in ("cluster/ray_shell/fleet.py", "cluster/in_process/fleet.py"):
        source = (ROOT / fleet).read_text(encoding="utf-8")
        assert "StalenessGate(" in source and "stale_refused" not in source, fleet
