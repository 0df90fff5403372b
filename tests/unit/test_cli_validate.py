"""``grpo-cluster validate`` (checks only: exit 0 with the resolved spec's summary, or 2 naming the problem) and
``grpo-cluster --version``. The ``--address`` resource check against a real cluster is in
tests/ray/test_local_cluster.py."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from cluster.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "tiny_cpu.yaml"


def _spec_file(tmp_path: Path, model: str) -> Path:
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(5)] + ["not json"]
    data.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: check\noutput_dir: {tmp_path / 'out' / 'deeper'}\ntotal_steps: 3\n"
                    f"model: {{path: {model}}}\ndata: {{train_path: {data}, on_bad_row: skip}}\nmetrics: {{port: 0}}\n")
    return spec


def test_good_spec_prints_summary_exits_0_and_writes_nothing(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", "rollout.group_size=8"]) == 0
    out = capsys.readouterr().out
    assert f"spec:       {spec} — job 'check', 3 steps, from step 0, seed 0" in out
    assert f"model:      {tiny_model_dir} -> {tiny_model_dir} (float32); tokenizer loaded" in out
    assert f"data:       5 prompts from {tmp_path / 'train.jsonl'} (1 bad rows skipped, 0 over" in out
    assert "x G=8 completions per step" in out  # --set applied
    assert "cluster:    a local Ray cluster on 127.0.0.1" in out
    assert out.rstrip().endswith("valid: nothing was started or written")
    assert not (tmp_path / "out").exists()  # output_dir (and its parent) not created


def test_bad_spec_exits_2_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    text = EXAMPLE.read_text().replace("  replicas: 1\n", "  replicas: 0\n")
    assert text != EXAMPLE.read_text()
    bad.write_text(text)
    line = text.splitlines().index("  replicas: 0") + 1
    assert main(["validate", str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:{line}: rollout.replicas" in captured.err and captured.out == ""


def test_bad_inputs_exit_2_naming_the_field(tmp_path, tiny_model_dir, capsys):
    spec = _spec_file(tmp_path, tiny_model_dir)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["validate", str(spec), "--set", f"output_dir={blocker}/sub"]) == 2
    assert f"output_dir: cannot write to {blocker}/sub: {blocker} is not a folder" in capsys.readouterr().err
    assert main(["validate", str(spec), "--set", f"model.path={tmp_path / 'nope'}"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["validate", str(spec), "--set", "data.max_prompt_tokens=5"]) == 2
    assert "all 5 prompts are longer than data.max_prompt_tokens=5" in capsys.readouterr().err
    assert main(["validate", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "cannot reach a Ray cluster at 127.0.0.1:1 (--address)" in capsys.readouterr().err


def test_version_is_the_package_metadata(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"grpo-cluster {version('grpo-cluster')}\n"


def test_input_errors_name_the_spec_file_and_line_of_the_field(tmp_path, tiny_model_dir, capsys):
    """Model, data and output-folder problems are found after the spec is valid; they still say where the value was
    written (file:line, or the --set that gave it), like spec errors."""
    spec = _spec_file(tmp_path, tmp_path / "no_model")
    line = spec.read_text().splitlines().index(f"model: {{path: {tmp_path / 'no_model'}}}") + 1
    assert main(["validate", str(spec)]) == 2
    assert capsys.readouterr().err.startswith(f"grpo-cluster: {spec}:{line}: model.path: model folder "
                                              f"{tmp_path / 'no_model'} not found")
    assert main(["validate", str(spec), "--set", f"model.path={tmp_path / 'nope'}"]) == 2
    assert capsys.readouterr().err.startswith("grpo-cluster: --set model.path: model folder")
    spec = _spec_file(tmp_path, tiny_model_dir)
    (tmp_path / "train.jsonl").unlink()
    line = next(i for i, text in enumerate(spec.read_text().splitlines(), 1) if text.startswith("data:"))
    assert main(["validate", str(spec)]) == 2
    assert capsys.readouterr().err.startswith(f"grpo-cluster: {spec}:{line}: data.train_path: data file "
                                              f"{tmp_path / 'train.jsonl'} not found")
    assert not (tmp_path / "out").exists()


def test_custom_resources_on_the_local_cluster_exit_2(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """Without --address, `run` starts a local cluster with no custom resources (cluster/ray_shell/ray_init.py), where
    pools reserving ``rollout.resources`` could never be placed; validate said "valid" and run stopped after starting
    Ray."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", "rollout.resources={rollout_node: 1}"]) == 2
    err = capsys.readouterr().err
    assert "needs rollout_node 1 (rollout 1 x 1), cluster has 0" in err
    assert "the local Ray cluster `run` starts without --address: CPU " in err and "no custom resources" in err
    assert main(["validate", str(spec)]) == 0
    assert not (tmp_path / "out").exists()


def test_cpu_affinity_outside_this_machine_exits_2(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """The local cluster runs every actor here: a core this process may not use is refused before Ray starts, naming
    the field and where it was set; cores that exist are shown in the summary."""
    import os

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir)
    allowed = sorted(os.sched_getaffinity(0))
    absent = max(allowed) + 1
    assert main(["validate", str(spec), "--set", f"train.cpu_affinity=[{allowed[0]}, {absent}]"]) == 2
    err = capsys.readouterr().err
    assert (f"--set train.cpu_affinity: cores [{absent}] are not among this machine's usable "
            f"cores {allowed}") in err, err
    assert main(["validate", str(spec), "--set", f"rollout.cpu_affinity=[{allowed[-1]}]", "--set",
                 f"train.cpu_affinity=[{allowed[0]}]"]) == 0
    out = capsys.readouterr().out
    assert f"on cores [{allowed[-1]}]" in out and f"backend gloo (auto); on cores [{allowed[0]}]" in out, out
    assert not (tmp_path / "out").exists()
