"""The ``eval`` spec section and ``checkpoint.keep_best``: defaults, invalid values named with file:line, checks
across sections, and bad held-out data refused by ``grpo-cluster validate`` (exit 2, naming the field) before any
Ray cluster starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.spec import EvalSpec, SpecError, load_spec, load_spec_text, spec_to_yaml

BASE = "output_dir: out\ntotal_steps: 4\ndata: {train_path: train.jsonl, test_path: test.jsonl}\n"


def test_absent_section_means_no_eval_and_empty_or_null_too():
    assert load_spec_text(BASE).eval is None
    assert load_spec_text(BASE + "eval:\n").eval is None
    assert load_spec_text(BASE + "eval: null\n").eval is None
    assert load_spec_text(BASE).checkpoint.keep_best is False


def test_defaults_are_greedy_pass_at_1_at_start_and_end():
    ev = load_spec_text(BASE + "eval: {}\n").eval
    assert ev == EvalSpec()
    assert (ev.every_steps, ev.at_start, ev.at_end, ev.samples, ev.temperature) == (None, True, True, 1, 0.0)
    assert (ev.limit, ev.max_tokens, ev.data_path) == (None, None, None)
    assert (ev.accuracy_reward, ev.format_reward) == ("accuracy", "format")


def test_set_overrides_reach_the_optional_section_and_round_trip():
    spec = load_spec_text(BASE, overrides=["eval.every_steps=2", "eval.limit=50", "checkpoint.keep_best=true"])
    assert (spec.eval.every_steps, spec.eval.limit, spec.checkpoint.keep_best) == (2, 50, True)
    assert load_spec_text(spec_to_yaml(spec)) == spec
    with pytest.raises(SpecError, match="--set eval.nope=1: unknown key 'nope' at eval; allowed: every_steps"):
        load_spec_text(BASE, overrides=["eval.nope=1"])


@pytest.mark.parametrize(("section", "field", "message"), [
    ("eval: {every_steps: 0}", "eval.every_steps", "greater than or equal to 1"),
    ("eval: {every_steps: 2.5}", "eval.every_steps", "valid integer"),
    ("eval: {limit: 0}", "eval.limit", "greater than or equal to 1"),
    ("eval: {max_tokens: 0}", "eval.max_tokens", "greater than or equal to 1"),
    ("eval: {samples: 0}", "eval.samples", "greater than or equal to 1"),
    ("eval: {samples: 4}", "eval.samples", "samples=4 needs eval.temperature > 0"),
    ("eval: {temperature: -1}", "eval.temperature", "greater than or equal to 0"),
    ("eval: {temperature: 0.005}", "eval.temperature", "expected 0 (greedy) or a temperature >= 0.01"),
    ("eval: {accuracy_reward: nope}", "eval.accuracy_reward",
     "unknown reward 'nope'; allowed: accuracy, code, code_asserts, format, math, reasoning_gym; register"),
    ("eval: {format_reward: nope}", "eval.format_reward", "unknown reward 'nope'"),
    ("eval: {at_start: false, at_end: false}", "eval.every_steps", "eval never runs"),
    ("eval: {max_tokens: 300}", "eval.max_tokens", "expected data.max_prompt_tokens + eval.max_tokens <= the engine "
                                                   "context (data.max_prompt_tokens + rollout.max_response_tokens = "
                                                   "768), got 512 + 300"),
    ("eval: {unknown: 1}", "eval.unknown", "unknown key 'unknown'; allowed: every_steps"),
    ("eval: {data_path: ''}", "eval.data_path", "empty string: expected a non-empty value"),  # was "file . is a folder"
    ("eval: {temperature: true}", "eval.temperature", "Input should be a valid number"),  # was 1.0
    ("checkpoint: {keep_best: true}", "checkpoint.keep_best", "it needs an eval section"),
])
def test_invalid_values_name_the_field_and_line(section, field, message):
    with pytest.raises(SpecError) as err:
        load_spec_text(BASE + section + "\n", source="job.yaml")
    assert f"job.yaml:4: {field}: " in str(err.value) and message in str(err.value)


def test_a_held_out_file_is_required_and_a_longer_cap_fits_a_larger_context():
    with pytest.raises(SpecError, match="job.yaml:3: data.test_path: empty string: expected a non-empty value"):
        load_spec_text("output_dir: o\ntotal_steps: 2\ndata: {train_path: t, test_path: ''}\neval: {}\n",
                       source="job.yaml")
    with pytest.raises(SpecError, match="eval.data_path: expected a held-out file: set eval.data_path"):
        load_spec_text("output_dir: o\ntotal_steps: 2\ndata: {train_path: t}\neval: {}\n")
    spec = load_spec_text(BASE + "rollout: {max_model_len: 1024}\neval: {max_tokens: 512, data_path: held.jsonl}\n")
    assert (spec.eval.max_tokens, spec.eval.data_path) == (512, "held.jsonl")


def test_relative_data_path_resolves_next_to_the_spec_file(tmp_path):
    (tmp_path / "held.jsonl").write_text("{}\n")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(BASE + "eval: {data_path: held.jsonl}\n")
    assert load_spec(spec_file).eval.data_path == str(tmp_path / "held.jsonl")
    spec_file.write_text(BASE + "eval: {data_path: elsewhere.jsonl}\n")  # not next to the spec: left as written
    assert load_spec(spec_file).eval.data_path == "elsewhere.jsonl"


def _job(tmp_path: Path, model: str, eval_block: str) -> Path:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(5)))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: check\noutput_dir: {tmp_path / 'out'}\ntotal_steps: 3\nmodel: {{path: {model}}}\n"
                    f"data: {{train_path: {train}}}\nmetrics: {{port: 0}}\n{eval_block}\n")
    return spec


def test_validate_refuses_bad_held_out_data_with_exit_2_naming_the_field(tmp_path, tiny_model_dir, capsys,
                                                                          monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    missing = tmp_path / "missing.jsonl"
    spec = _job(tmp_path, tiny_model_dir, f"eval: {{data_path: {missing}}}")
    line = spec.read_text().splitlines().index(f"eval: {{data_path: {missing}}}") + 1
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{line}: eval.data_path: data file {missing} not found" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["validate", str(_job(tmp_path, tiny_model_dir, f"eval: {{data_path: {empty}}}"))]) == 2
    assert f"eval.data_path: {empty}: no usable rows" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer here"}\n')
    assert main(["validate", str(_job(tmp_path, tiny_model_dir, f"eval: {{data_path: {bad}}}"))]) == 2
    assert f"eval.data_path: {bad}:1: " in capsys.readouterr().err
    assert main(["validate", str(_job(tmp_path, tiny_model_dir, "eval: {limit: -1}"))]) == 2
    assert "eval.limit: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_validate_accepts_a_good_eval_section(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": f"What is {i} times 3?", "answer": f"#### {3 * i}"}) + "\n"
                            for i in range(4)))
    spec = _job(tmp_path, tiny_model_dir, f"eval: {{data_path: {held}, limit: 3}}\ncheckpoint: {{keep_best: true}}")
    assert main(["validate", str(spec)]) == 0
    captured = capsys.readouterr()
    assert f"eval: 3 held-out prompts x 1 from {held}" in captured.err
    assert f"eval:       3 held-out prompts x 1 from {held} (greedy, at most 256 tokens), at start, at end\n" in \
        captured.out
    assert not (tmp_path / "out").exists()
