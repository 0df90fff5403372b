"""The spec described by itself: ``docs/configuration.md`` is what ``python -m cluster.ops.spec_docs`` prints (so it
cannot drift from the field descriptions), ``grpo-cluster spec --defaults`` prints a complete spec that loads and that
``grpo-cluster validate`` accepts, and ``grpo-cluster spec --schema`` prints a JSON Schema that accepts every example
spec and refuses a misspelt key."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.cli import main
from cluster.ops.spec_docs import reference_markdown
from cluster.spec import JobSpec, load_spec_text
from cluster.spec.reference import REQUIRED_CHOICES, SCHEMA_HINT, default_spec

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_the_committed_configuration_reference_is_current():
    """Fails after a spec field, default or description changed without regenerating the page."""
    assert PAGE.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/configuration.md is stale: run `python -m cluster.ops.spec_docs > docs/configuration.md`")


def test_the_reference_lists_every_field_of_every_section_once():
    text = reference_markdown()

    def fields(model, prefix):
        for name, field in model.model_fields.items():
            dotted = f"{prefix}{name}"
            yield dotted
            sub = field.annotation if isinstance(field.annotation, type) else next(
                (a for a in getattr(field.annotation, "__args__", ()) if isinstance(a, type) and a is not type(None)),
                None)
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                yield from fields(sub, f"{dotted}.")

    for dotted in fields(JobSpec, ""):
        assert text.count(f"| `{dotted}` |") == 1, dotted
    assert "| `rollout.group_size` | int, >= 2, <= 1024 | `4` | G: completions per prompt" in text


def test_spec_defaults_prints_a_complete_spec_that_loads(capsys):
    """``grpo-cluster spec --defaults``"""
    assert main(["spec", "--defaults"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(SCHEMA_HINT + "\n")
    spec = load_spec_text(text)
    assert spec == default_spec() and spec.model.path == "builtin:SmolLM2-135M-Instruct"
    written = yaml.safe_load(text)
    assert set(written) == set(JobSpec.model_fields)  # every section and top-level field written out
    assert written["rollout"]["group_size"] == 4 and written["output_dir"] == REQUIRED_CHOICES["output_dir"]


def test_validate_accepts_the_printed_defaults(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """``grpo-cluster spec --defaults > job.yaml && grpo-cluster validate job.yaml`` (with the tiny model in place
    of the builtin one, so the test does not convert the 135M model)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["spec", "--defaults"]) == 0
    spec = tmp_path / "job.yaml"
    spec.write_text(capsys.readouterr().out)
    assert main(["validate", str(spec), "--set", f"model.path={tiny_model_dir}", "--set",
                 f"output_dir={tmp_path / 'out'}"]) == 0
    assert "valid: nothing was started or written" in capsys.readouterr().out


def test_spec_schema_accepts_the_examples_and_refuses_a_misspelt_key(capsys):
    """``grpo-cluster spec --schema``"""
    assert main(["spec", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    examples = sorted((REPO / "examples").rglob("*.yaml"))
    assert examples
    for path in examples:
        errors = list(validator.iter_errors(yaml.safe_load(path.read_text())))
        assert not errors, (path, [e.message for e in errors])
    bad = yaml.safe_load((REPO / "tests" / "tiny_cpu.yaml").read_text())
    bad["rollout"]["group_sise"] = 4
    bad["sync"]["bucket_bytes"] = "64 parsecs"
    messages = [e.message for e in validator.iter_errors(bad)]
    assert any("group_sise" in m for m in messages) and any("64 parsecs" in m for m in messages), messages


@pytest.mark.parametrize("argv, message", [
    (["spec"], "grpo-cluster spec: one of the arguments --defaults --schema is required"),
    (["spec", "--defaults", "--schema"], "grpo-cluster spec: --schema: not allowed with argument --defaults"),
])
def test_spec_needs_exactly_one_of_defaults_and_schema(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
