"""The off-policy default (issue 30, item 2): ``rollout.mode`` one_step_off and async get token-level truncated
importance sampling against the engine's logprobs (cap ``DEFAULT_TIS_CAP``) unless the spec chooses a correction or
turns every correction off with ``algorithm.off_policy_correction: none``, which ``grpo-cluster validate`` and the
job's start warn about. The spec is never rewritten: the train ranks get :func:`effective_algorithm`'s copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.spec import JobSpec, SpecError, load_spec_text
from cluster.spec.algorithm import DEFAULT_TIS_CAP, describe_off_policy, effective_algorithm, off_policy_warning

MODES = {"sync": {"mode": "sync"}, "one_step_off": {"mode": "one_step_off", "max_staleness": 1},
         "async": {"mode": "async", "max_staleness": 3}}


def _spec(tmp_path: Path, mode: str, **algorithm) -> JobSpec:
    return JobSpec.model_validate({"output_dir": str(tmp_path), "total_steps": 2, "model": {"path": "unused"},
                                   "data": {"train_path": str(tmp_path / "unused.jsonl")},
                                   "rollout": MODES[mode], "algorithm": algorithm})


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_off_policy_modes_train_with_token_tis_by_default(tmp_path, mode):
    spec = _spec(tmp_path, mode)
    assert spec.algorithm.off_policy_correction == "auto" and spec.algorithm.tis_cap is None  # spec untouched
    run = effective_algorithm(spec.algorithm, spec.rollout)
    assert (run.tis_cap, run.tis_level, run.mis) == (DEFAULT_TIS_CAP, "token", None)
    assert DEFAULT_TIS_CAP == 2.0
    assert "token-level TIS, cap 2 (the default" in describe_off_policy(spec.algorithm, spec.rollout)
    assert off_policy_warning(spec.algorithm, spec.rollout) is None


def test_sync_and_a_chosen_correction_are_left_as_they_are(tmp_path):
    sync = _spec(tmp_path, "sync")
    assert effective_algorithm(sync.algorithm, sync.rollout) is sync.algorithm
    chosen = _spec(tmp_path, "async", tis_cap=3.0, tis_level="sequence")
    assert effective_algorithm(chosen.algorithm, chosen.rollout) is chosen.algorithm
    assert "sequence-level TIS, cap 3" in describe_off_policy(chosen.algorithm, chosen.rollout)
    mis = _spec(tmp_path, "one_step_off", mis={"level": "token", "low": 0.5, "high": 2.0})
    run = effective_algorithm(mis.algorithm, mis.rollout)
    assert run is mis.algorithm and run.tis_cap is None  # MIS chosen: no TIS added on top
    assert "token-level MIS, band [0.5, 2]" in describe_off_policy(mis.algorithm, mis.rollout)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_none_turns_the_default_off_and_is_warned_about(tmp_path, mode):
    spec = _spec(tmp_path, mode, off_policy_correction="none")
    run = effective_algorithm(spec.algorithm, spec.rollout)
    assert run.tis_cap is None and run.mis is None
    warning = off_policy_warning(spec.algorithm, spec.rollout)
    assert warning is not None and "off_policy_correction: none" in warning and mode in warning
    assert "NO behaviour correction" in describe_off_policy(spec.algorithm, spec.rollout)
    assert off_policy_warning(_spec(tmp_path, "sync", off_policy_correction="none").algorithm,
                              _spec(tmp_path, "sync").rollout) is None  # on-policy: nothing to warn about


@pytest.mark.parametrize("chosen", ["algorithm.tis_cap=2.0", 'algorithm.mis={"level": "token", "low": 0.5, "high": 2}'])
def test_none_with_a_correction_set_is_refused_naming_the_field(chosen):
    text = "output_dir: runs/t\ntotal_steps: 3\ndata: {train_path: t.jsonl}\nrollout: {mode: async, max_staleness: 2}\n"
    name = chosen.split("=")[0].removeprefix("algorithm.")
    with pytest.raises(SpecError, match=rf"algorithm.off_policy_correction: .*'none' turns every behaviour "
                                        rf"correction off, but algorithm.{name} is set"):
        load_spec_text(text, source="job.yaml", overrides=["algorithm.off_policy_correction=none", chosen])


def _spec_file(tmp_path: Path, model: str, extra: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(5)))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: check\noutput_dir: {tmp_path / 'out'}\ntotal_steps: 3\nmodel: {{path: {model}}}\n"
                    f"data: {{train_path: {data}}}\nmetrics: {{port: 0}}\n{extra}")
    return spec


def test_validate_prints_the_correction_and_warns_when_it_is_off(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir, "rollout: {mode: async, max_staleness: 2}\n")
    assert main(["validate", str(spec)]) == 0
    captured = capsys.readouterr()
    assert ("off-policy: rollout.mode async: samples up to 2 policy version(s) old; token-level TIS, cap 2 (the "
            "default, algorithm.off_policy_correction: auto)") in captured.out
    assert "warning" not in captured.err
    assert main(["validate", str(spec), "--set", "algorithm.off_policy_correction=none"]) == 0
    captured = capsys.readouterr()
    assert "NO behaviour correction" in captured.out
    assert "warning: algorithm.off_policy_correction: none with rollout.mode async" in captured.err
