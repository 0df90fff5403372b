"""What the experiment trackers (``metrics.trackers``) add to a training step: the seconds each tracker's sink spends in
``log()`` per step, against a step's wall time.

What is measured: the four sinks :func:`cluster.sinks.trackers.build_trackers` gives a job with ``metrics.trackers:
[wandb, mlflow, tensorboard, trackio]`` (each tracker whose library is installed), in their default local modes (wandb
offline, MLflow's SQLite store, TensorBoard event files, trackio's SQLite database) under a temporary ``output_dir``.
Each step logs one row shaped like the demo's: the 48 keys of a real step of the SmolLM2 GSM8K run
(``tests/data/step_metrics_smollm2.json``) plus the held-out ``eval/*`` keys, values varied per step. One warm-up
step, then ``--steps`` timed ones; the time of each sink's ``log()`` is the sink's own counter
(:attr:`TrackerSink.log_seconds`), i.e. what the driver waits for. The start (``wandb.init``, MLflow's database) and the
close (plot rendering, artifacts, finishing the run) happen once per job and are reported apart.

Reported: per tracker and for all together, the mean and p90 seconds per step's ``log()``, and the total as a share of
``--step-s`` (default: the real step's ``timing/step_s``, 89 s; the CPU demo's steps take ≈ 50 s, given with
``--step-s 50``).

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_trackers                 # 50 timed steps
    .venv/bin/python -m bench.bench_trackers --steps 200 --step-s 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import load_note, print_json, print_table

REAL_STEP = Path(__file__).resolve().parents[1] / "tests" / "data" / "step_metrics_smollm2.json"
EVAL_ROW = {"eval/accuracy": 0.05, "eval/accuracy_ci_low": 0.03, "eval/accuracy_ci_high": 0.08, "eval/n": 200,
            "eval/problems": 200, "eval/format_rate": 0.1, "eval/response_length_mean": 180.0,
            "eval/truncated_fraction": 0.2, "eval/best_accuracy": 0.05, "eval/best_step": 0}


def _row(base: dict, step: int) -> dict:
    """The real row with every number moved a little, so no tracker sees a constant."""
    return {k: (v * (1 + 0.001 * step) if isinstance(v, float) else v) for k, v in base.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps after one warm-up step")
    parser.add_argument("--step-s", type=float, default=None, help="a step's wall seconds to compare with "
                        "(default: the real step's timing/step_s)")
    parser.add_argument("--trackers", nargs="+", default=["wandb", "mlflow", "tensorboard", "trackio"])
    args = parser.parse_args()

    import importlib.util

    from cluster.sinks.trackers import build_trackers, tracker_class
    from cluster.spec import load_spec_text

    base = {k: v for k, v in json.loads(REAL_STEP.read_text()).items() if k != "step"}
    base.update(EVAL_ROW)
    step_s = args.step_s or float(base["timing/step_s"])
    trackers = [t for t in args.trackers if importlib.util.find_spec(tracker_class(t).package) is not None]
    missing = sorted(set(args.trackers) - set(trackers))
    note = load_note()
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec_text(f"name: bench_trackers\noutput_dir: {tmp}\ntotal_steps: {args.steps + 1}\n"
                              f"data: {{train_path: {tmp}/unused.jsonl}}\n"
                              f"metrics: {{port: null, trackers: {json.dumps(trackers)}}}\n")
        import os

        os.environ.setdefault("TRACKIO_DIR", f"{tmp}/trackio")
        t0 = time.perf_counter()
        sinks = build_trackers(spec, tmp)
        start_s = time.perf_counter() - t0
        per_step = {s.name: [] for s in sinks}
        (Path(tmp) / "metrics.jsonl").write_text("")
        with (Path(tmp) / "metrics.jsonl").open("a") as jsonl:
            for step in range(args.steps + 1):
                row = _row(base, step)
                jsonl.write(json.dumps({"step": step, **row}) + "\n")
                jsonl.flush()
                for sink in sinks:
                    before = sink.log_seconds
                    sink.log(step, row)
                    if step > 0:
                        per_step[sink.name].append(sink.log_seconds - before)
        t0 = time.perf_counter()
        for sink in sinks:
            sink.close()
        close_s = time.perf_counter() - t0
        failed = {s.name: s.failed for s in sinks if s.failed}
    totals = [sum(values) for values in zip(*per_step.values())] if per_step else [0.0]
    rows = [[name, statistics.mean(v), sorted(v)[int(0.9 * (len(v) - 1))], 100 * statistics.mean(v) / step_s]
            for name, v in per_step.items()]
    rows.append(["all", statistics.mean(totals), sorted(totals)[int(0.9 * (len(totals) - 1))],
                 100 * statistics.mean(totals) / step_s])
    print(f"{len(base)} keys per row, {args.steps} timed steps; trackers {trackers}"
          f"{f' (not installed: {missing})' if missing else ''}; failures {failed or 'none'}")
    print_table(["tracker", "log s/step (mean)", "p90", f"% of a {step_s:.0f} s step"], rows)
    print(f"once per job: start {start_s:.2f} s, close (plot, artifacts, finish) {close_s:.2f} s; machine "
          f"{note['cpus']} CPUs, load average {note['loadavg_1m']} at start")
    print_json("trackers", {"trackers": trackers, "missing": missing, "failed": failed, "keys": len(base),
                            "steps": args.steps, "step_s": step_s,
                            "mean_log_s": {r[0]: r[1] for r in rows}, "p90_log_s": {r[0]: r[2] for r in rows},
                            "percent_of_step": {r[0]: r[3] for r in rows}, "start_s": start_s, "close_s": close_s,
                            "machine": note})


if __name__ == "__main__":
    main()
