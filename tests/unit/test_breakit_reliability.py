"""Regression tests from a hostile-user pass over the reliability features (issue #7) and the job commands (#6).

Each test pins one bug found by hand: a spec, resume or CLI input that must end in a clear error (exit 2, naming the
file) or in correct behaviour, never a traceback or silently lost data. No Ray is started; GRPOJob(...) only reads
files in ``__init__``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from tests.stand_ins import stand_in_job

TINY = str(Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml")  # not relative to the working folder
from cluster.loop.checkpoints import TRAINER_STATE, latest_checkpoint
from cluster.loop.setup import SetupError
from cluster.spec import SpecError, load_spec_text

BASE = "output_dir: /tmp/x\ntotal_steps: 2\ndata: {train_path: t.jsonl}\n"


# ---------------------------------------------------------------------------------------------------- spec loading
def test_recursive_yaml_alias_is_a_spec_error_not_a_recursion_error(tmp_path):
    """``rollout: &a {replicas: *a}`` made _collect_lines recurse until RecursionError (traceback, exit 1)."""
    text = BASE + "rollout: &a\n  replicas: *a\n"
    with pytest.raises(SpecError, match="rollout"):
        load_spec_text(text, source="alias.yaml")


def test_cli_run_recursive_alias_exits_2(tmp_path, capsys):
    spec = tmp_path / "alias.yaml"
    spec.write_text(BASE + "rollout: &a\n  replicas: *a\n")
    assert main(["run", str(spec), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(spec) in err and "Traceback" not in err


@pytest.mark.parametrize("address", ["http://[::1", "http://127.0.0.1:99999", "http://127.0.0.1:abc"])
@pytest.mark.parametrize("command", [["submit", TINY], ["status", "j"], ["logs", "j"], ["stop", "j"]],
                         ids=["submit", "status", "logs", "stop"])
def test_cli_job_commands_malformed_address_exit_2(command, address, capsys):
    """A malformed ``--address`` raised ValueError out of urllib/ray ('Invalid IPv6 URL', 'Port out of range
    0-65535', 'Port could not be cast to integer') — a traceback with exit 1 (``scale`` already gave exit 2)."""
    assert main([*command, "--address", address]) == 2
    assert address in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- resume
def _state(step: int, num_examples: int = 5) -> dict:
    return {"step": step, "policy_version": step, "pending_prompts": [], "kl_coef": 0.04, "group_size": {"raised": 0},
            "sampler": {"epoch": 0, "offset": 0, "seed": 0, "shuffle": True, "num_examples": num_examples}}


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / TRAINER_STATE).write_text(json.dumps(_state(step)))
    return path


def test_latest_checkpoint_orders_by_step_number_not_by_name(tmp_path):
    """total_steps allows 10,000,000, but ``step_1000000`` sorts before ``step_999999`` as a string, so resume took
    the older checkpoint (and keep_last pruning deleted the newer one)."""
    _checkpoint(tmp_path, 999_999)
    newest = _checkpoint(tmp_path, 1_000_000)
    assert latest_checkpoint(tmp_path) == newest


def _spec(tmp_path: Path, model: str, *overrides: str):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(5)))
    text = (f"output_dir: {tmp_path / 'out'}\ntotal_steps: 10\nmodel: {{path: {model}}}\n"
            f"data: {{train_path: {data}}}\nmetrics: {{port: null}}\n")
    return load_spec_text(text, overrides=overrides)


def test_resume_with_torn_metrics_line_is_not_a_traceback(tmp_path, tiny_model_dir):
    """A crash while appending to metrics.jsonl leaves a torn last line; ``--resume`` then died in _truncate_jsonl
    with a bare JSONDecodeError (not caught by the CLI: traceback). Now the torn row is dropped (it is past the
    checkpoint anyway) and the job resumes at the checkpoint's step."""
    spec = _spec(tmp_path, tiny_model_dir)
    _checkpoint(tmp_path / "out" / "checkpoints", 2)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "loss"')
    job = stand_in_job(spec, progress=False, resume=True)  # the torn row is past the checkpoint: dropped
    assert job.step == 2
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_fresh_run_in_reused_output_dir_does_not_prune_its_own_checkpoint(tmp_path, tiny_model_dir):
    """A run without --resume in an output_dir holding an older run's step_000010: with keep_last=1 the new run's
    step_000001 is pruned right after it is written (step_000010 sorts newer), and a later --resume silently
    continues the *old* run. Now refused at set-up, naming checkpoint.dir and the way on, and nothing is deleted."""
    spec = _spec(tmp_path, tiny_model_dir, "checkpoint.keep_last=1")
    root = tmp_path / "out" / "checkpoints"
    old = _checkpoint(root, 10)  # left by an earlier run
    expected = (f"checkpoint.dir: {root} already holds checkpoints of an earlier run (latest step_000010); continue "
                f"it with `grpo-cluster run --resume` (or resume: auto), or choose another output_dir / "
                f"checkpoint.dir — nothing was deleted")
    with pytest.raises(SetupError) as err:
        stand_in_job(spec, progress=False, resume=False)
    assert str(err.value) == expected
    assert sorted(p.name for p in root.iterdir()) == ["step_000010"] and (old / TRAINER_STATE).is_file()


@pytest.mark.parametrize("field", ["rollout.timeout_s", "train.timeout_s", "sync.timeout_s"])
def test_absurd_timeouts_are_spec_errors(field):
    """Timeouts had no upper bound: ``train.timeout_s=1e300`` passed the spec and then overflowed
    ``timedelta(seconds=...)`` inside the train worker at start-up (OverflowError, after Ray had started)."""
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        load_spec_text(BASE, overrides=[f"{field}=1e300"])


@pytest.mark.parametrize("how", ["flag", "env"])
def test_run_with_a_jobs_api_http_address_exits_2(tmp_path, tiny_model_dir, monkeypatch, capsys, how):
    """``run --address http://HOST:8265`` (or ``RAY_ADDRESS=http://HOST:8265`` exported for ``submit``, as
    docs/operations.md suggests) ended in ray.init's ValueError traceback (exit 1) instead of exit 2 pointing at
    ``submit`` / a GCS address. ray.init rejects the address before starting anything, so this test starts no
    cluster."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    args = ["run", TINY, "--no-progress", "--set", f"model.path={tiny_model_dir}",
            "--set", f"output_dir={tmp_path / 'out'}", "--set", f"data.train_path={data}", "--set", "metrics.port=null"]
    if how == "flag":
        args += ["--address", "http://127.0.0.1:1"]
    else:
        monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:1")
    assert main(args) == 2
    assert "http://127.0.0.1:1" in capsys.readouterr().err
    import logging  # the refused run removed its output folder: no log handler is left pointing into it

    assert not [h for h in logging.getLogger().handlers
                if str(tmp_path) in str(getattr(h, "baseFilename", ""))], logging.getLogger().handlers


# --------------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_lone_surrogate_question_is_a_bad_row(tmp_path, on_bad_row):
    """``"\\ud800"`` is valid JSON but not encodable text: the row passed load_jsonl_examples and then crashed the
    tokenizer in GRPOJob.__init__ (TypeError: TextEncodeInput must be ..., a traceback without file or line), even
    with on_bad_row: skip. Expected: a bad row like invalid UTF-8 — DataError with file:line, or skipped."""
    from cluster.data import DataError, load_jsonl_examples

    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "What is 1 + 1? \\ud800", "answer": "#### 2"}\n'
                    '{"question": "What is 2 + 2?", "answer": "#### 4"}\n')
    if on_bad_row == "error":
        with pytest.raises(DataError, match=rf"{path}:1"):
            load_jsonl_examples(path, on_bad_row="error")
    else:
        examples, skipped = load_jsonl_examples(path, on_bad_row="skip")
        assert skipped == 1 and [ex.question for ex in examples] == ["What is 2 + 2?"]
