"""``grpo-cluster eval --spec`` equals the loop's held-out evaluation for the same weights: a 2-step ``local_job`` on
the tiny random Llama evaluates at step 0 and at the end (on the in-process fleet); ``eval --spec --engine
transformers`` of the starting model and of the final checkpoint (a fresh model loaded from disk) gives the same
``eval/*`` figures. Scored by a test reward that pays about half of the (prompt, completion) pairs (by their CRC-32),
so accuracy is neither 0 nor 1 (≈ 15 s)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.in_process import local_job
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import temporarily_registered

FIGURES = ("eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high", "eval/n", "eval/problems",
           "eval/response_length_mean", "eval/truncated_fraction")


def crc_parity(prompts: list[str], completions: list[str]) -> list[float]:
    """1.0 when the prompt and completion together have an even CRC-32, else 0.0: about half of the held-out rows
    (the random tiny model's greedy completions may be the same text for every prompt)."""
    return [float(zlib.crc32(f"{p}\n{c}".encode()) % 2 == 0) for p, c in zip(prompts, completions)]


@pytest.fixture(scope="module")
def crc_reward():
    yield from temporarily_registered("crc_parity", crc_parity)


def _problems(path: Path, count: int, offset: int) -> str:
    path.write_text("".join(json.dumps({"question": f"Add {i} and {3 * i + 1}, then explain.", "answer": "#### 0"})
                            + "\n" for i in range(offset, offset + count)))
    return str(path)


def test_own_task_eval_spec_reproduces_the_in_loop_evaluation(tiny_model_dir, crc_reward, tmp_path, capsys):
    from cluster.cli import main
    from cluster.spec import spec_to_yaml

    spec = local_spec(
        tiny_model_dir, str(tmp_path / "run"),
        data={"train_path": _problems(tmp_path / "train.jsonl", 6, 0), "max_prompt_tokens": 256},
        algorithm={"kl_coef": 0.04, "rewards": {"crc_parity": 1.0}},
        eval={"data_path": _problems(tmp_path / "held_out.jsonl", 12, 100), "max_tokens": 8,
              "accuracy_reward": "crc_parity", "format_reward": None},
        metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": True})
    job = local_job(spec, progress=False)
    with stopped_after(job):
        job.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert 0 < evals[0]["eval/accuracy"] < 1 and evals[0]["eval/problems"] == 12

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(spec_to_yaml(spec))
    final = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (final / "config.json").is_file()
    for model, in_loop in ((tiny_model_dir, evals[0]), (str(final), evals[1])):
        capsys.readouterr()
        assert main(["eval", "--spec", str(spec_file), "--model", model, "--engine", "transformers", "--json"]) == 0
        got = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert {k: got[k] for k in FIGURES} == {k: in_loop[k] for k in FIGURES}, model
    start, trained = (load_file(str(Path(m) / "model.safetensors")) for m in (tiny_model_dir, final))
    assert any(k in trained and not torch.equal(v, trained[k]) for k, v in start.items())  # another model
