"""Refusals found by trying to break the command line (issue 30's sweep, by kind): a refused ``run`` leaves no folder
it created behind; an ``--import`` that is empty, or whose module exits or raises while it is imported, and a reward
file that calls ``sys.exit`` on import are each one message and exit code 2, never a traceback or a silent exit."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from grpo.rewards.calling import RewardError
from grpo.rewards.loading import load_reward

TINY = str(Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml")  # not relative to the working folder


def test_a_refused_run_removes_the_output_folder_it_created(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run_out"
    code = main(["run", TINY, "--set", f"output_dir={out}", "--set", f"model.path={tiny_model_dir}",
                 "--set", f"data.train_path={tmp_path / 'missing.jsonl'}", "--no-progress"])
    assert code == 2 and "data.train_path" in capsys.readouterr().err
    assert not out.exists()


def test_a_refused_run_keeps_a_folder_that_was_there(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "kept"
    (out / "notes").mkdir(parents=True)
    code = main(["run", TINY, "--set", f"output_dir={out}", "--set", f"model.path={tiny_model_dir}",
                 "--set", f"data.train_path={tmp_path / 'missing.jsonl'}", "--no-progress"])
    assert code == 2 and (out / "notes").is_dir()


@pytest.mark.parametrize("source, message", [
    ("", "expected a module name"),
    ("import sys\nsys.exit(3)\n", "the module exited while it was imported (SystemExit: 3)"),
    ("raise RuntimeError('no GPU here')\n", "the module raised while it was imported: RuntimeError: no GPU here"),
])
def test_import_problems_are_one_message(source, message, tmp_path, monkeypatch, capsys):
    name = ""
    if source:
        name = "breakit_import_mod"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["validate", TINY, "--import", name]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_reward_file_that_exits_on_import_is_a_reward_error(tmp_path):
    (tmp_path / "sysexit.py").write_text("import sys\nsys.exit(3)\n\ndef f(completions, references):\n    return []\n")
    with pytest.raises(RewardError, match=r"sysexit\.py:2: cannot import .*sysexit\.py: SystemExit: 3"):
        load_reward("sysexit.py:f", tmp_path)
