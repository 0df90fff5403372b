"""Messages a new user meets, each tried with the exact command a user types (``main([...])`` is ``grpo-cluster
...``): what they say, that they name what the user wrote (the flag, the ``--set``, the file line), and their exit
codes. One test per kind of message (issue #29, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path, model: str, extra: str = "") -> Path:
    """A small valid spec on a 3-row jsonl file and the tiny model, with ``extra`` YAML appended."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(3)))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: msg\noutput_dir: {tmp_path / 'out'}\ntotal_steps: 2\nmodel: {{path: {model}}}\n"
                    f"data: {{train_path: {data}}}\nmetrics: {{port: 0}}\n{extra}")
    return spec


def test_no_command_prints_the_help_and_exits_0(capsys):
    """``grpo-cluster``"""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: grpo-cluster") and "validate" in out and "spec" in out and "error" not in out


def test_misspelt_keys_get_the_closest_key_in_yaml_at_every_level(tmp_path, capsys):
    """``grpo-cluster validate job.yaml`` with ``prompt_per_step``, ``group_sise`` and a nested ``tsk``."""
    spec = _spec(tmp_path, "m", "rollout: {prompt_per_step: 4, group_sise: 4}\n")
    spec.write_text(spec.read_text().replace("data: {", "data: {source: reasoning_gym, reasoning_gym: {tsk: x}, "))
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "rollout.prompt_per_step: unknown key 'prompt_per_step' (did you mean 'prompts_per_step'?)" in err
    assert "rollout.group_sise: unknown key 'group_sise' (did you mean 'group_size'?)" in err
    assert "data.reasoning_gym.tsk: unknown key 'tsk' (did you mean 'task'?)" in err
    assert err.count("invalid job spec") == 1 and "invalid spec:" not in err  # one header


@pytest.mark.parametrize("override, suggestion", [
    ("rollout.group_sise=8", "unknown key 'group_sise' at rollout (did you mean 'group_size'?)"),
    ("train.lora.rnk=8", "unknown key 'rnk' at train.lora (did you mean 'rank'?)"),
    ("rolout.group_size=8", "unknown key 'rolout' at top level (did you mean 'rollout'?)"),
])
def test_misspelt_keys_get_the_closest_key_in_set(tmp_path, capsys, override, suggestion):
    """``grpo-cluster validate job.yaml --set rollout.group_sise=8`` (and nested, and top level)."""
    assert main(["validate", str(_spec(tmp_path, "m")), "--set", override]) == 2
    assert f"grpo-cluster: --set {override}: {suggestion}; allowed: " in capsys.readouterr().err


def test_a_set_value_of_the_wrong_type_names_the_field_once(tmp_path, capsys):
    """``grpo-cluster validate job.yaml --set train.lr=abc``"""
    assert main(["validate", str(_spec(tmp_path, "m")), "--set", "train.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert "  --set train.lr: Input should be a valid number (got 'abc')" in err
    assert err.count("train.lr") == 1 and err.count("invalid") == 1


def test_a_missing_spec_file_is_not_found_not_invalid(tmp_path, capsys):
    """``grpo-cluster validate /missing.yaml`` and ``grpo-cluster run /missing.yaml``"""
    for command in ("validate", "run"):
        assert main([command, str(tmp_path / "missing.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"grpo-cluster: {tmp_path / 'missing.yaml'}: spec file not found")
        assert "invalid" not in err


def test_a_conflict_caused_by_set_is_blamed_on_the_set(tmp_path, capsys):
    """``grpo-cluster validate job.yaml --set rollout.max_response_tokens=1000`` where the file says
    ``max_model_len: 700``: the --set made the spec inconsistent, not the file's line."""
    spec = _spec(tmp_path, "m", "rollout: {max_model_len: 700}\n")
    assert main(["validate", str(spec), "--set", "rollout.max_response_tokens=1000"]) == 2
    err = capsys.readouterr().err
    assert ("  --set rollout.max_response_tokens: rollout.max_model_len (written at "
            f"{spec}:7): expected max_model_len >= data.max_prompt_tokens + rollout.max_response_tokens") in err


def test_a_mode_implies_its_required_setting(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """``grpo-cluster validate job.yaml --set rollout.mode=one_step_off`` is valid: the mode implies
    max_staleness 1 (an explicit 0 is still refused, naming both --set keys)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", "rollout.mode=one_step_off"]) == 0
    assert "mode one_step_off (max_staleness 1)" in capsys.readouterr().out
    assert main(["validate", str(spec), "--set", "rollout.mode=one_step_off", "--set", "rollout.max_staleness=0"]) == 2
    assert "--set rollout.max_staleness, --set rollout.mode: rollout.max_staleness:" in capsys.readouterr().err


def test_validate_counts_the_local_gpus_as_run_will_and_summarises_the_training(tmp_path, tiny_model_dir, capsys,
                                                                                monkeypatch):
    """``grpo-cluster validate job.yaml --set train.num_gpus_per_worker=N`` with more GPUs than this machine has
    (1 on a machine without one) exits 2; the summary of a valid spec names the strategy, the torch.distributed
    backend, the learning rate and its schedule, the objective, the rewards, and where the metrics go (each tracker with
    its files)."""
    from cluster.ray_shell.ray_init import local_cluster_resources
    from cluster.spec.reference import default_spec

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    gpus = local_cluster_resources(default_spec())["GPU"]
    spec = _spec(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", f"train.num_gpus_per_worker={gpus + 1:g}"]) == 2
    err = capsys.readouterr().err
    assert f"needs GPU {gpus + 1:g} (rollout 1 x 0 + train 1 x {gpus + 1:g}), cluster has {gpus:g}" in err
    assert "the local Ray cluster `run` starts without --address" in err
    assert main(["validate", str(spec), "--set", "train.lr=3e-6"]) == 0
    out = capsys.readouterr().out
    assert "train:      1 rank(s), strategy fsdp, torch.distributed backend gloo (auto)" in out
    assert "optimizer:  AdamW lr 3e-06 (constant over 2 steps)" in out
    assert "algorithm:  advantages grpo, loss seq-mean-token-mean, ratio clipped to [0.8, 1.2]" in out
    assert "rewards:    accuracy x1 (" in out and "format x0.1 (" in out
    out_dir = tmp_path / "out"
    assert main(["validate", str(spec), "--set", f"output_dir={out_dir}", "--set", "metrics.port=null",
                 "--set", "metrics.trackers=[tensorboard, mlflow]"]) == 0
    out = capsys.readouterr().out
    assert (f"metrics:    {out_dir / 'metrics.jsonl'}, a console line every 1 step(s), no Prometheus endpoint "
            f"(metrics.port null); trackers: tensorboard ({out_dir / 'tensorboard'}), mlflow (sqlite:///"
            f"{out_dir / 'mlflow' / 'mlflow.db'})") in out, out


def test_an_output_folder_that_cannot_be_written_is_refused_for_real(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """``grpo-cluster validate job.yaml --set output_dir=/proc/grpo_out``: ``os.access`` says root may write in
    /proc, but no file can be created there; validate tries, and leaves nothing behind where it can write."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", "output_dir=/proc/grpo_out"]) == 2
    assert ("--set output_dir: cannot write to /proc/grpo_out: a file cannot be created in /proc"
            in capsys.readouterr().err)
    assert main(["validate", str(spec)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "train.jsonl"]


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "m", "--data", "d.jsonl", "--limit", "0"], "--limit: expected a whole number >= 1, got 0"),
    (["eval", "--model", "m", "--data", "d.jsonl", "--limit", "ten"], "--limit: expected a whole number >= 1, got ten"),
    (["eval", "--model", "m", "--data", "d.jsonl", "--max-tokens", "-5"],
     "--max-tokens: expected a whole number >= 1, got -5"),
    (["scale", "j", "--rollout-replicas", "0"], "--rollout-replicas: expected a whole number >= 1, got 0"),
    (["stop", "j", "--wait-s", "nan"], "--wait-s: expected a number of seconds >= 0, got nan"),
])
def test_bad_flag_values_are_named_as_typed(capsys, argv, message):
    """``grpo-cluster eval ... --limit 0`` and the other typed flags: argparse's error, not Python's."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"grpo-cluster {argv[0]}: {message}\n" in err and "None" not in err and "invalid int" not in err


def test_eval_names_its_flags_not_spec_fields(tmp_path, capsys):
    """``grpo-cluster eval --model M --data /missing.jsonl`` names --data (not data.train_path); a missing --model
    names --model (not model.path); an unreadable --against names --against."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    assert main(["eval", "--model", str(tmp_path), "--data", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-cluster eval: --data: data file {tmp_path / 'missing.jsonl'} not found")
    assert "Point --data at a jsonl file" in err and "data.train_path" not in err
    assert main(["eval", "--model", str(tmp_path / "no_model"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-cluster eval: --model: model folder {tmp_path / 'no_model'} not found")
    assert "model.path" not in err
    assert main(["eval", "--model", str(tmp_path), "--data", str(data), "--against", str(tmp_path / "b.jsonl")]) == 2
    assert f"--against {tmp_path / 'b.jsonl'}: cannot read it: No such file or directory" in capsys.readouterr().err


def test_eval_per_problem_folder_is_tried_for_real(tmp_path, capsys):
    """``grpo-cluster eval --model M --data D --per-problem /proc/out.jsonl``: root passes os.access there, but no
    file can be created; refused before the engine starts."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(data), "--per-problem", "/proc/out.jsonl"]) == 2
    assert "--per-problem /proc/out.jsonl: a file cannot be created in /proc" in capsys.readouterr().err


def test_plot_of_a_running_job_leaves_out_the_partial_last_line_with_a_note(tmp_path, capsys):
    """``grpo-cluster plot RUN_DIR`` while the job is writing metrics.jsonl's last line; the title is the job's name
    from its spec.yaml and counts training steps (the step-0 evaluation row is not a step)."""
    from cluster.sinks.plot import job_name, run_data

    run = tmp_path / "dev_run_7"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.1}] + [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "reward/me')
    (run / "spec.yaml").write_text("name: learn_cpu\noutput_dir: x\n")
    assert main(["plot", str(run)]) == 0
    captured = capsys.readouterr()
    assert f"grpo-cluster plot: note: {run / 'metrics.jsonl'}:5: left out a partial last line" in captured.err
    assert (run / "plot.png").is_file() and "wrote" in captured.out
    assert run_data(run).num_steps == 3 and job_name(run) == "learn_cpu"


@pytest.mark.parametrize(("env", "metrics", "expected"), [
    ({}, {"port": 0, "trackers": []}, "Prometheus on a free port of 127.0.0.1; trackers: none (metrics.trackers)"),
    ({"MLFLOW_TRACKING_URI": "https://user:s3cret@mlflow.example.com"}, {"trackers": ["mlflow"]},
     "trackers: mlflow (https://user:***@mlflow.example.com)"),
    ({"WANDB_MODE": "disabled"}, {"trackers": ["wandb"]}, "trackers: wandb (disabled ($WANDB_MODE): nothing written)"),
    ({"TRACKIO_DIR": ""}, {"trackers": ["trackio"]}, "trackers: trackio ({out}/trackio)"),
])
def test_validate_says_where_metrics_go_without_secrets(tmp_path, monkeypatch, env, metrics, expected):
    """The ``metrics:`` line of ``validate``: the place each tracker writes (as the tracker will resolve it: an empty
    $TRACKIO_DIR is unset), a tracking URI without its password, a free Prometheus port said in words."""
    from cluster.ops.cli_validate import metrics_summary
    from cluster.spec.reference import default_spec

    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = default_spec()
    spec = spec.model_copy(update={"output_dir": str(tmp_path), "metrics": spec.metrics.model_copy(update=metrics)})
    assert expected.format(out=tmp_path) in metrics_summary(spec)
