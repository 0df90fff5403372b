"""``cluster.data.evaluate.evaluate_gsm8k``: argument checks before anything loads, the row limit, and the engine
context length sized from the longest tokenized prompt, prompts handed to vLLM as token ids; ``grpo-cluster eval
--per-problem/--against``: bad files refused before the engine starts, naming file and line (vLLM and the tokenizer
replaced by fakes)."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from cluster.data.evaluate import check_eval_args, engine_max_model_len, evaluate_gsm8k


@pytest.mark.parametrize("limit, max_tokens, message", [
    (0, 256, r"--limit: expected a whole number >= 1 \(or no --limit: all rows\), got 0"),
    (-3, 256, r"--limit: .* got -3"),
    (True, 256, r"--limit: .* got True"),
    (2.5, 256, r"--limit: .* got 2.5"),
    (None, 0, r"--max-tokens: expected a whole number >= 1, got 0"),
    (5, -1, r"--max-tokens: .* got -1"),
    (5, 1.5, r"--max-tokens: .* got 1.5"),
])
def test_bad_arguments_raise_before_loading_anything(tmp_path, limit, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        check_eval_args(limit, max_tokens)
    # tmp_path is no model folder and the data file does not exist: the argument check must come first.
    with pytest.raises(ValueError, match=message):
        evaluate_gsm8k(str(tmp_path), str(tmp_path / "missing.jsonl"), limit=limit, max_tokens=max_tokens)


def test_engine_context_is_longest_prompt_plus_max_tokens():
    assert engine_max_model_len([5, 1900, 3], 256) == 2156
    with pytest.raises(ValueError, match="at least one prompt"):
        engine_max_model_len([], 256)


class FakeTokenizer:
    """One token per whitespace-separated word of the rendered chat."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return " ".join(m["content"] for m in messages) + " <assistant>"

    def __call__(self, texts, add_special_tokens):
        assert add_special_tokens is False  # the chat template already wrote the special tokens
        return {"input_ids": [list(range(len(text.split()))) for text in texts]}


def install_fakes(monkeypatch) -> dict:
    """Fake vllm (LLM, SamplingParams), tokenizer and model resolution; returns what LLM was built with (through the
    vLLM rollout engine, ``rollout_workers.vllm.engine.VLLMEngine``)."""
    seen: dict = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params, use_tqdm, lora_request=None):
            seen["prompts"] = prompts
            out = types.SimpleNamespace(text="2 + 3 = 5 apples in the basket, so 5 in all.\n#### 5",
                                        token_ids=[1, 2, 3], finish_reason="stop",
                                        logprobs=[{t: types.SimpleNamespace(logprob=-0.5)} for t in (1, 2, 3)])
            return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[out]) for p in prompts]

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.LLM = LLM
    fake_vllm.SamplingParams = lambda **kwargs: kwargs
    fake_inputs = types.ModuleType("vllm.inputs")
    fake_inputs.TokensPrompt = lambda **kwargs: kwargs
    fake_vllm.inputs = fake_inputs
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", fake_inputs)
    import transformers

    import cluster.data.models

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda path: FakeTokenizer()))
    monkeypatch.setattr(cluster.data.models, "resolve_model_path", lambda model, **_: model)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    return seen


def write_rows(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n" for q in questions))
    return path


def test_limit_and_context_length(tmp_path, monkeypatch):
    seen = install_fakes(monkeypatch)
    long_question = " ".join(["word"] * 2000)  # longer than the old fixed 1024-token allowance
    data = write_rows(tmp_path / "d.jsonl", ["short?", long_question, "also short?"])

    result = evaluate_gsm8k("fake-model", str(data), limit=2, max_tokens=64, system_prompt="sys")
    assert result["n"] == 2 and result["pass@1"] == 1.0 and result["format"] == 1.0
    assert [len(p["prompt_token_ids"]) for p in seen["prompts"]] == [1 + 1 + 1, 1 + 2000 + 1]  # token prompts, no text
    assert seen["max_model_len"] == (1 + 2000 + 1) + 64  # "sys", the question, "<assistant>"; plus max_tokens

    result = evaluate_gsm8k("fake-model", str(data), limit=None, max_tokens=64, system_prompt="sys")
    assert result["n"] == 3
    result = evaluate_gsm8k("fake-model", str(data), limit=1, max_tokens=8, system_prompt=None)
    assert result["n"] == 1 and seen["max_model_len"] == (1 + 1) + 8


def test_per_problem_file_and_paired_comparison_from_the_cli(tmp_path, monkeypatch, capsys):
    from cluster.cli import main

    install_fakes(monkeypatch)
    data = tmp_path / "d.jsonl"  # the fake engine answers 5 to everything: rows 0 and 2 right, 1 and 3 wrong
    data.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"#### {a}"}) + "\n"
                            for i, a in enumerate([5, 6, 5, 7])))
    out = tmp_path / "now.jsonl"
    assert main(["eval", "--model", "fake", "--data", str(data), "--per-problem", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["correct"], r["truncated"]) for r in rows] == [(0, 1.0, False), (1, 0.0, False),
                                                                          (2, 1.0, False), (3, 0.0, False)]
    assert rows[0]["completion"].endswith("#### 5") and rows[0]["tokens"] == 3
    assert [r["question"] for r in rows] == ["q0?", "q1?", "q2?", "q3?"]

    base = tmp_path / "base.jsonl"  # the baseline had rows 1 and 3 right: 2 gained, 2 lost
    base.write_text("".join(json.dumps({"index": i, "correct": c}) + "\n" for i, c in enumerate([0, 1, 0, 1])))
    capsys.readouterr()
    assert main(["eval", "--model", "fake", "--data", str(data), "--against", str(base), "--json"]) == 0
    printed = capsys.readouterr().out
    assert f"against {base}: 2 -> 2 correct of 4; 2 gained, 2 lost; McNemar exact p = 1.000" in printed
    assert json.loads(printed.splitlines()[-1])["paired"]["gained"] == 2

    assert main(["eval", "--model", "fake", "--data", str(data), "--limit", "3", "--against", str(base)]) == 2
    assert "4 problems, this evaluation has 3; use the same --data and --limit" in capsys.readouterr().err
    base.write_text(json.dumps({"index": 0, "correct": 0.5}) + "\n")
    assert main(["eval", "--model", "fake", "--data", str(data), "--against", str(base)]) == 2
    assert f"{base}:1: expected a per-problem row" in capsys.readouterr().err


def gsm8k_rows(path: Path, answers: list[int], prefix: str = "q") -> Path:
    path.write_text("".join(json.dumps({"question": f"{prefix}{i}?", "answer": f"#### {a}"}) + "\n"
                            for i, a in enumerate(answers)))
    return path


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("", ":? no per-problem rows \\(empty file\\)"),
    ('{"index": 0, "correct": 1}\n{"index": 1, "corr', ":2: expected a per-problem row"),  # truncated last line
    ('{"index": 0, "correct": 1}\n{"index": 0, "correct": 0}\n', ":2: expected a per-problem row .* \\(index 1,"),
    (b"\xff\xfe\x00binary", ":1: expected a per-problem row"),
    ('{"index": 0, "correct": 1, "question": 7}\n', ":1: expected a per-problem row"),
    ('[0, 1]\n', ":1: expected a per-problem row"),
    ('{"index": 0, "correct": 1}\n', "1 problems, this evaluation has 4; use the same --data and --limit"),
    ("".join(json.dumps({"index": i, "question": f"q{q}?", "correct": 0}) + "\n" for i, q in enumerate([0, 1, 3, 2])),
     ":3: problem 2 is 'q3\\?', in --data it is 'q2\\?'; use the same --data"),  # other order
    ("".join(json.dumps({"index": i, "question": f"other{i}?", "correct": 0}) + "\n" for i in range(4)),
     ":1: problem 0 is 'other0\\?', in --data it is 'q0\\?'"),  # another dataset of the same size
])
def test_bad_against_file_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys, content, message):
    from cluster.cli import main

    seen = install_fakes(monkeypatch)
    data = gsm8k_rows(tmp_path / "d.jsonl", [5, 6, 5, 7])
    base = tmp_path / "base.jsonl"
    if isinstance(content, bytes):
        base.write_bytes(content)
    elif content is not None:
        base.write_text(content)
    out = tmp_path / "now.jsonl"
    assert main(["eval", "--model", "fake", "--data", str(data), "--against", str(base), "--per-problem",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert str(base) in err
    assert re.search(message, err), err
    assert not seen and not out.exists()  # no engine built, nothing written


def test_against_a_folder_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys):
    from cluster.cli import main

    seen = install_fakes(monkeypatch)
    data = gsm8k_rows(tmp_path / "d.jsonl", [5])
    assert main(["eval", "--model", "fake", "--data", str(data), "--against", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err and not seen


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder; give a file path"),
    ("no_such_folder/out.jsonl", "does not exist"),
    ("d.jsonl", "is the --data file"),
])
def test_bad_per_problem_path_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys, where, message):
    from cluster.cli import main

    seen = install_fakes(monkeypatch)
    data = gsm8k_rows(tmp_path / "d.jsonl", [5, 6])
    (tmp_path / "folder").mkdir()
    assert main(["eval", "--model", "fake", "--data", str(data), "--per-problem", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert f"--per-problem {tmp_path / where}: " in err and message in err, err
    assert not seen
    assert json.loads(data.read_text().splitlines()[0])["answer"] == "#### 5"  # the dataset is untouched


def test_failed_per_problem_write_after_evaluation_still_prints_the_figures(tmp_path, monkeypatch, capsys):
    import cluster.data.evaluate
    from cluster.cli import main

    install_fakes(monkeypatch)
    data = gsm8k_rows(tmp_path / "d.jsonl", [5, 6])
    out = tmp_path / "now.jsonl"
    out.write_text("earlier file\n")

    def disk_full(fh_path, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cluster.data.evaluate.os, "replace", disk_full)
    assert main(["eval", "--model", "fake", "--data", str(data), "--per-problem", str(out), "--json"]) == 2
    captured = capsys.readouterr()
    assert "GSM8K pass@1 = 0.5000 on 2 problems" in captured.out
    assert json.loads(captured.out.splitlines()[-1])["n"] == 2
    assert f"--per-problem {out}: not written: [Errno 28] No space left on device" in captured.err
    assert out.read_text() == "earlier file\n"  # the earlier file is whole and no temporary file is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "now.jsonl"]


def test_per_problem_may_replace_the_against_file(tmp_path, monkeypatch, capsys):
    from cluster.cli import main

    install_fakes(monkeypatch)
    data = gsm8k_rows(tmp_path / "d.jsonl", [5, 6, 5])
    base = tmp_path / "base.jsonl"
    base.write_text("".join(json.dumps({"index": i, "question": f"q{i}?", "correct": c}) + "\n"
                            for i, c in enumerate([0, 1, 1])))
    assert main(["eval", "--model", "fake", "--data", str(data), "--against", str(base), "--per-problem",
                 str(base)]) == 0
    assert "2 -> 2 correct of 3; 1 gained, 1 lost" in capsys.readouterr().out  # compared with the old contents
    rows = [json.loads(line) for line in base.read_text().splitlines()]
    assert [(r["index"], r["question"], r["correct"]) for r in rows] == [(0, "q0?", 1.0), (1, "q1?", 0.0),
                                                                         (2, "q2?", 1.0)]
