"""What a fresh clone holds is enough: every spec under ``examples/`` reads only files inside the repository (nothing
from ``../shared`` beside a project machine's checkout), and each one that needs no network passes
``grpo-cluster validate`` exactly as the README tells a new user to run it. The hub-backed ones (a hub model or
``data.source: hf_hub``) are checked for the first part only.

Why the older checks missed ``../shared`` paths: ``load_spec`` and the JSON schema never open the data files, and the
one test that read an example's data skipped where ``../shared`` was missing. Here a path leaving the repository fails
whether or not the folder it points at exists on this machine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
#: The project's packages: their messages reach users of any checkout.
PACKAGES = ("cluster", "contract", "grpo", "rollout_workers", "sandbox", "train_workers", "weight_sync")


def _strings(node) -> list[str]:
    """Every string value in a parsed YAML document (mapping keys included: reward files are keys)."""
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in (*_strings(key), *_strings(value))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def _needs_network(spec) -> bool:
    """A hub model (not a builtin alias, not a folder) or a hub dataset: validating downloads it."""
    model = spec.model.path
    return (not model.startswith("builtin:") and not Path(model).exists()) or spec.data.source == "hf_hub"


def test_fresh_clone_examples_are_found():
    assert len(EXAMPLES) >= 10 and not [p for p in EXAMPLES if p.name == "tiny_cpu.yaml"]  # the tests' job: tests/


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_fresh_clone_example_reads_nothing_outside_the_repository(path):
    """Every relative path a spec writes (``../`` in it, resolved against the spec's folder) stays in the
    repository, and the data files it names exist there."""
    from cluster.spec import load_spec

    outside = [s for s in _strings(yaml.safe_load(path.read_text())) if "../" in s
               and not (path.parent / s.split(":")[0]).resolve().is_relative_to(REPO)]
    assert not outside, f"{path}: reads outside the repository (absent on a fresh clone): {outside}"
    spec = load_spec(path)
    named = [p for p in (spec.data.train_path, spec.data.test_path, spec.eval and spec.eval.data_path) if p]
    missing = [p for p in named if not (path.parent / p).is_file()]
    assert not missing, f"{path}: data files not in the repository: {missing}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_fresh_clone_example_validates_offline(path, tmp_path, monkeypatch, capsys):
    """``grpo-cluster validate EXAMPLE`` (only ``output_dir`` moved to a temporary folder, so nothing lands in the
    checkout)."""
    from cluster.cli import main
    from cluster.spec import load_spec

    if _needs_network(load_spec(path)):
        pytest.skip(f"{path.name} reads the Hugging Face Hub (a hub model or data.source: hf_hub)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["validate", str(path), "--set", f"output_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "valid: nothing was started or written" in captured.out


def _message_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings (what its messages and defaults say)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_fresh_clone_no_message_points_users_at_shared():
    """No error message or default of the project's packages sends a user to ``../shared/...`` (the folder beside
    the project machines' checkout, which a clone does not have)."""
    modules = [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]
    found = [(str(path.relative_to(REPO)), text) for path in modules for text in _message_strings(path)
             if "shared/data" in text]
    assert not found, found
