"""The shipped examples of issue #27: ``make demo`` runs ``examples/demo_cpu.yaml`` (the measured learning run's task
and settings, shorter, evaluated at the start and the end, nothing outside the repository), and the GSM8K spec reads
the hub dataset or, as its comment says, a local copy."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}
    return {prefix: value}


def test_own_task_make_demo_runs_the_demo_spec():
    target = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert target is not None and target.group(1) == ".venv/bin/grpo-cluster run examples/demo_cpu.yaml"


def test_own_task_demo_is_the_learning_run_shortened():
    """Only the name, output folder, length and eval/checkpoint cadence differ from examples/learn_cpu.yaml; the
    held-out split is generated (no data file), evaluated before step 1 and after the last step."""
    demo, learn = load_spec(EXAMPLES / "demo_cpu.yaml"), load_spec(EXAMPLES / "learn_cpu.yaml")
    a, b = _flat(demo.model_dump()), _flat(learn.model_dump())
    assert {k for k in a if a[k] != b[k]} == {".name", ".output_dir", ".total_steps", ".eval.every_steps",
                                              ".checkpoint.every_steps"}
    assert (demo.total_steps, demo.eval.every_steps, demo.eval.at_start, demo.eval.at_end) == (15, None, True, True)
    assert demo.data.source == "reasoning_gym" and demo.data.train_path is None and demo.eval.data_path is None
    assert demo.model.path == "builtin:SmolLM2-135M-Instruct" and demo.resume == "auto"
    assert demo.monitor.verifiable_reward == "reasoning_gym" and demo.checkpoint.save_final


def test_own_task_gsm8k_spec_reads_the_hub_or_a_local_copy(gsm8k_train_path):
    """The spec names openai/gsm8k (config main); the overrides its comment gives read a local folder instead."""
    from cluster.data.sources import load_examples
    from cluster.loop.setup import reward_checks

    spec = load_spec(EXAMPLES / "gsm8k_smollm2_cpu.yaml")
    assert (spec.data.source, spec.data.hub.name, spec.data.hub.config) == ("hf_hub", "openai/gsm8k", "main")
    overrides = re.search(r"--set (data\.hub\.name)=\S+ --set (data\.hub\.config=)\n",
                          (EXAMPLES / "gsm8k_smollm2_cpu.yaml").read_text())
    assert overrides is not None
    local = load_spec(EXAMPLES / "gsm8k_smollm2_cpu.yaml",
                      [f"{overrides.group(1)}={gsm8k_train_path.parent}", overrides.group(2)])
    checks = reward_checks(list(local.algorithm.rewards), "algorithm.rewards")
    train, skipped = load_examples(local.data, "train", checks)
    held_out, _ = load_examples(local.data, "held_out", checks)
    assert (len(train), len(held_out), skipped) == (7473, 1319, 0)
    assert train[0].question.startswith("Natalia sold clips") and train[0].reference == "72"
