"""How much of a LoRA update a merged sync loses to the engine dtype's rounding, measured on the real loop: a LoRA
job with ``train.lora.sync: merged`` run on the in-process runtime (``cluster.in_process.local_job``: transformers
sampling + one FSDP2 rank, no Ray) once per ``model.dtype`` (float32, bfloat16), every number read from the run's
``metrics.jsonl``.

Per step: ``sync/merge_rounding_error`` = ‖cast(W + sBA) − W − sBA‖ / ‖sBA‖ (the merged weights the engine holds
against the trainer's policy, in units of the update), ``sync/merge_update_error`` = ‖cast(W + sBA) − cast(W) − sBA‖
/ ‖sBA‖ (the part of the update lost; the loop warns above ``cluster.loop.training.MERGE_ROUNDING_BOUND``), and
``rollout/logprob_diff`` (engine vs trainer logprobs of the sampled tokens). Both errors are over every merged tensor
(``train_workers.lora.MergeRounding``).

Models: ``--model tiny`` (the tests' random tiny Llama, float32 weights off the bf16 grid; seconds per step) or
``--model smollm2`` (``examples/gsm8k_smollm2_cpu.yaml``: SmolLM2-135M-Instruct on GSM8K prompts, B = 2 × G = 4, 64
tokens; ≈ 30 s per step here). Both are scored by the tests' ``parity`` reward (1 for an even character count), so
every step has unequal rewards and a non-zero update to measure (GSM8K accuracy is ≈ 0 at this length). LoRA rank
8, alpha 16, all linear layers, kl_coef 0, lr from ``--lr``.

Usage (from the repo root)::

    flock /tmp/grpo-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_lora_rounding --model smollm2 \\
        --steps 4 --lr 5e-6 1e-4 --out /tmp/bench_lora_rounding

Prints a table (one row per dtype × lr × step) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench._common import REPO_ROOT, load_note, print_json, print_table
from cluster.loop.training import MERGE_ROUNDING_BOUND
from cluster.sinks.metrics import read_metrics_jsonl

SPECS = {"tiny": REPO_ROOT / "tests" / "tiny_cpu.yaml", "smollm2": REPO_ROOT / "examples" / "gsm8k_smollm2_cpu.yaml"}
COMMON = ["eval=null", "metrics.port=null", "checkpoint.every_steps=0", "checkpoint.save_final=false",
          "resume=never", "monitor=null", "train.world_size=1", "train.lora.rank=8", "train.lora.alpha=16",
          "train.lora.sync=merged", "algorithm.kl_coef=0.0"]
#: Per model: overrides besides COMMON.
PARITY = 'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}'
MODEL = {"tiny": [PARITY],
         "smollm2": [PARITY, "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=64"]}
KEYS = ("sync/merge_rounding_error", "sync/merge_update_error", "rollout/logprob_diff")


def run(model: str, dtype: str, lr: float, steps: int, out: Path, model_dir: str | None) -> list[dict]:
    """One job; returns its training rows' :data:`KEYS` per step plus ``wall_s`` of the whole job."""
    from cluster.in_process import local_job
    from cluster.spec import load_spec

    run_dir = out / f"{model}_{dtype}_lr{lr:g}"
    overrides = [*COMMON, *MODEL[model], f"model.dtype={dtype}", f"train.lr={lr}", f"total_steps={steps}",
                 f"output_dir={run_dir}", *([f"model.path={model_dir}"] if model_dir else [])]
    spec = load_spec(SPECS[model], overrides)
    print(f"[bench_lora_rounding] {model} {dtype} lr {lr:g}: {steps} steps -> {run_dir}", flush=True)
    t0 = time.perf_counter()
    job = local_job(spec, progress=False)
    try:
        job.run()
    finally:
        job.close()
        job.shutdown()
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    return [{"model": model, "dtype": dtype, "lr": lr, "step": r["step"], **{k: r.get(k) for k in KEYS},
             "wall_s": wall} for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(SPECS), default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-4])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_lora_rounding"))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/bench_off_policy_tiny_llama"),
                        help="--model tiny: the tiny random Llama's folder (built there once)")
    args = parser.parse_args(argv)
    import tests.parity_reward  # noqa: F401  (registers the parity reward)

    model_dir = None
    if args.model == "tiny":
        from tests.tiny_model import make_tiny_model

        model_dir = make_tiny_model(args.model_dir)
    rows = [row for lr in args.lr for dtype in args.dtypes
            for row in run(args.model, dtype, lr, args.steps, args.out, model_dir)]

    def num(v) -> str:
        return "-" if v is None else f"{v:.3g}"

    print_table(["model", "dtype", "lr", "step", "rounding error", "update error", "logprob_diff"],
                [[r["model"], r["dtype"], f"{r['lr']:g}", r["step"], num(r[KEYS[0]]), num(r[KEYS[1]]),
                  num(r[KEYS[2]])] for r in rows],
                title=f"merged LoRA sync: rounding of the update per step (warning above {MERGE_ROUNDING_BOUND:g})")
    print_json("bench_lora_rounding", {"model": args.model, "steps": args.steps, "bound": MERGE_ROUNDING_BOUND,
                                       **load_note(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
