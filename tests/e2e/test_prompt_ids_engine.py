"""The real vLLM engine with a Llama-3-style tokenizer (chat template writes BOS, post-processor adds it again):
``RolloutEngine`` samples from exactly the training prompt ids (one BOS), where a text prompt gets two (~1 min).

    flock /tmp/heavy.lock .venv/bin/python -m pytest tests/e2e/test_prompt_ids_engine.py -m slow -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter: vLLM spawns its own engine processes (needs the __main__ guard).
SCRIPT = textwrap.dedent("""
    import json, sys

    def main(path, spec_path):
        from transformers import AutoTokenizer
        from vllm import SamplingParams

        from cluster.data import chat_prompt_ids, load_jsonl_examples
        from cluster.spec import load_spec
        from contract.messages import GroupRequest
        from rollout_workers.engine import RolloutEngine

        spec = load_spec(spec_path)
        tok = AutoTokenizer.from_pretrained(path)
        examples, _ = load_jsonl_examples(spec.data.train_path)
        ids = chat_prompt_ids(tok, examples, spec.data.system_prompt, spec.data.prompt_suffix)
        engine = RolloutEngine(path, spec.rollout, "float32", 0, 512)
        results, _ = engine.generate([GroupRequest(i, p) for i, p in enumerate(ids)], 2)
        text = tok.apply_chat_template([{"role": "user", "content": examples[0].question}], tokenize=False,
                                       add_generation_prompt=True)
        as_text = engine.llm.generate([text], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        print("RESULT " + json.dumps({"train": ids, "engine": [r.prompt_ids for r in results],
                                      "completions": [len(r.response_ids) for r in results],
                                      "text_prompt": list(as_text.prompt_token_ids), "bos": tok.bos_token_id}),
              flush=True)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
""")


def test_engine_prompt_ids_have_one_bos(tmp_path, tiny_model_dir):
    from tests.double_bos import make_double_bos_model

    model = make_double_bos_model(tiny_model_dir, tmp_path / "double_bos")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(2)))
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\nmodel: {{path: {model}}}\n"
                    f"data: {{train_path: {data}}}\nrollout: {{max_response_tokens: 4, kv_cache_gib: 1}}\n"
                    f"metrics: {{port: null}}\n")
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), model, str(spec)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    bos = out["bos"]
    assert out["engine"] == out["train"]  # RolloutEngine.generate also checks vLLM's own view of each prompt
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in out["train"])
    assert out["completions"] == [2, 2]
    assert out["text_prompt"][:2] == [bos, bos]  # why prompts go to vLLM as ids: a text prompt gets BOS twice
