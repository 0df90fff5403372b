"""The device check's driver (bench/gpu_check.py): verdicts, exit codes, per-section timeouts and the FLOPs count
behind its MFU. The sections themselves run in tests/distributed/test_gpu_check_dry.py."""

from __future__ import annotations

import json
import time

import pytest

from bench import gpu_check
from bench.gpu_check import Result, Section

ME = "tests.unit.test_gpu_check"


def section_pass(ctx):
    return Result("PASS", "fine", {"x": 1.5, "dry_run": ctx.dry_run, "backend": ctx.backend})


def section_fail(ctx):
    return Result("FAIL", "wrong by 3", {"err": 3.0})


def section_skip(ctx):
    return Result("SKIP", "needs CUDA")


def section_raise(ctx):
    raise ValueError("broken on purpose")


def section_hang(ctx):
    time.sleep(120)


def _run(monkeypatch, tmp_path, sections, *args):
    monkeypatch.setattr(gpu_check, "SECTIONS", tuple(sections))
    out = tmp_path / "result.json"
    code = gpu_check.main(["--dry-run", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out), *args])
    return code, json.loads(out.read_text())["sections"]


def test_any_fail_makes_the_exit_code_1(monkeypatch, tmp_path):
    code, got = _run(monkeypatch, tmp_path, [Section("a", f"{ME}:section_pass", 30, 30),
                                             Section("b", f"{ME}:section_fail", 30, 30),
                                             Section("c", f"{ME}:section_skip", 30, 30)])
    assert code == 1
    assert {k: v["status"] for k, v in got.items()} == {"a": "PASS", "b": "FAIL", "c": "SKIP"}
    assert got["a"]["numbers"] == {"x": 1.5, "dry_run": True, "backend": "gloo"}
    assert got["b"]["reason"] == "wrong by 3"


def test_pass_and_skip_exit_0(monkeypatch, tmp_path):
    code, got = _run(monkeypatch, tmp_path, [Section("a", f"{ME}:section_pass", 30, 30),
                                             Section("c", f"{ME}:section_skip", 30, 30)])
    assert code == 0 and [v["status"] for v in got.values()] == ["PASS", "SKIP"]


def test_an_exception_and_a_hang_are_failures_of_their_section_only(monkeypatch, tmp_path):
    t0 = time.perf_counter()
    code, got = _run(monkeypatch, tmp_path, [Section("boom", f"{ME}:section_raise", 30, 30),
                                             Section("hang", f"{ME}:section_hang", 30, 6),
                                             Section("after", f"{ME}:section_pass", 30, 30)])
    assert time.perf_counter() - t0 < 60
    assert code == 1
    assert got["boom"]["status"] == "FAIL" and "ValueError: broken on purpose" in got["boom"]["reason"]
    assert got["hang"]["status"] == "FAIL" and got["hang"]["reason"].startswith("timed out after 6 s")
    assert got["after"]["status"] == "PASS"
    assert "broken on purpose" in (tmp_path / "logs" / "boom.log").read_text()


def test_sections_past_the_budget_are_skipped(monkeypatch, tmp_path):
    code, got = _run(monkeypatch, tmp_path, [Section("a", f"{ME}:section_pass", 30, 30)], "--budget-s", "3")
    assert code == 0 and got["a"]["status"] == "SKIP" and "budget" in got["a"]["reason"]


def test_unknown_section_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--dry-run", "--only", "nope"])
    assert exc.value.code == 2


def test_model_flops_by_hand_and_parameter_count():
    """tiny (H 64, 2 layers, 4×16 query and 2×16 kv dims, MLP 128, V 512), one sequence of 2 prompt + 3 response
    tokens: N = 2·(64·64·2 + 64·32·2 + 3·64·128 + 2·64) + 64 = 74,048; FLOPs = 6·N·5 + 6·64·512·3 + 6·2·64·5²."""
    from bench.gpu_check_train import model_flops

    got = model_flops("tiny", [(2, 3)])
    assert got["params_non_embedding"] == 74_048
    assert got["params_total"] == 74_048 + 512 * 64
    assert got["flops"] == 6 * 74_048 * 5 + 6 * 64 * 512 * 3 + 6 * 2 * 64 * 25 == 2_830_464


def test_half_billion_config_has_the_parameters_it_claims():
    import torch
    from transformers import AutoModelForCausalLM

    from bench.gpu_check_train import llama_config, model_flops

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config("0.5b"))
    assert sum(p.numel() for p in model.parameters()) == model_flops("0.5b", [(1, 1)])["params_total"] == 494_005_120
    with torch.device("meta"):  # the megatron section's model (bench/gpu_check_megatron.py states 496.0 M)
        model = AutoModelForCausalLM.from_config(llama_config("0.5b-v32k"))
    assert sum(p.numel() for p in model.parameters()) == model_flops("0.5b-v32k", [(1, 1)])["params_total"] \
        == 496_026_624


def test_megatron_section_skips_with_the_reason_without_megatron_core(monkeypatch, tmp_path):
    """No megatron-core (the bare device image): the section SKIPs naming the import error and where the carry is
    documented, before it starts a process group."""
    import sys

    from bench.gpu_check import Context
    from bench.gpu_check_megatron import section_megatron

    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")] + ["megatron"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import megatron...` now raises ImportError
    result = section_megatron(Context(dry_run=True, device="cpu", backend="gloo", log_dir=str(tmp_path)))
    assert result.status == "SKIP", result
    assert "megatron-core does not import" in result.reason and "scripts/gpu_check.sh header" in result.reason


def test_async_overlap_contract_flags_what_the_schedules_must_not_do():
    """The async_overlap section's verdict on the steps it ran (bench/gpu_check_async.py ``_contract``): staleness 0 in
    sync, exactly 1 after the first step in one_step_off, 1..k in async; each step trains its own batch; finite
    losses; no stale drops."""
    from types import SimpleNamespace

    from bench.gpu_check_async import _contract

    def row(staleness, steps=None, losses=(0.5,), dropped=0):
        steps = steps or list(range(1, len(staleness) + 1))
        outcomes = [SimpleNamespace(trained={"step": s, "losses": list(losses)}) for s in steps]
        return {"staleness": list(staleness), "dropped": dropped, "_outcomes": outcomes}

    assert _contract("sync", 0, row([0, 0, 0]), 2) == []
    assert _contract("one_step_off", 1, row([0, 1, 1]), 2) == []
    assert _contract("async", 2, row([0, 2, 1]), 2) == []
    assert _contract("sync", 0, row([0, 1, 0]), 2) == ["sync: staleness [0, 1, 0]"]
    assert _contract("one_step_off", 1, row([0, 1, 2]), 2) == ["one_step_off: staleness [0, 1, 2]"]
    assert _contract("one_step_off", 1, row([0, 0, 1]), 2) == ["one_step_off: staleness [0, 0, 1]"]
    assert _contract("async", 2, row([0, 3, 1]), 2) == ["async: staleness [0, 3, 1]"]
    assert _contract("async", 2, row([0, 1, 2], steps=[1, 3, 3]), 2) == [
        "async: trained batches of steps [1, 3, 3], expected [1, 2, 3]"]
    assert _contract("sync", 0, row([0, 0, 0], losses=(float("nan"),)), 2) == [
        "sync: non-finite loss in [nan, nan, nan]"]
    assert _contract("async", 2, row([0, 1, 1], dropped=1), 2) == ["async: 1 stale drop(s)"]
