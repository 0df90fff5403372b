"""What goodput accounting and the health detectors add to a training step: the seconds the driver spends in them per
step, against a step's wall time.

What is measured, per step, on the demo's shape (``examples/demo_cpu.yaml``: 4 prompts × 8 completions of up to 128
tokens): the :class:`cluster.loop.goodput.GoodputLedger` reading four pools at the step's start and end
(``begin_step``/``end_step``), the driver's wait clock entered and left as often as a step of the loop does (one
``waiting`` block per generate call, collect, train step and sync, one ``working`` block per engine callback), and
:class:`cluster.loop.health.HealthMonitor.observe` on the step's row and 32 real SmolLM2 completions
(``tests/data/completions_smollm2.json``, the demo's chain_sum prompts). One warm-up step, then ``--steps`` timed.

Reported: the mean and p90 seconds per step and their share of ``--step-s`` (default: the median ``timing/step_s``
of the recorded demo run, ``bench/data/demo_cpu_15_steps.metrics.jsonl``). The demo's own run reports the same
accounting measured inside it (``summary.json``: ``goodput.accounting_s``).

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_goodput_overhead              # 200 timed steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench._common import REPO_ROOT, load_note, print_json, print_table

COMPLETIONS = REPO_ROOT / "tests" / "data" / "completions_smollm2.json"
DEMO_RUN = REPO_ROOT / "bench" / "data" / "demo_cpu_15_steps.metrics.jsonl"
WAITS_PER_STEP = 4  # generate, collect, train step, sync (sync mode, one sampling round)
CALLBACKS_PER_STEP = 1  # one engine: one on_groups callback


class _Pool:
    def __init__(self, name: str, workers: int, cores: float):
        self.name = name
        self.workers = workers
        self.cores = cores
        self.busy = 0.0

    def pool_times(self):
        from contract.goodput import PoolTime

        self.busy += 1.0
        return [PoolTime(self.name, self.workers, self.busy, cores=self.cores)]


def _demo_rows() -> list[dict]:
    return [r for r in map(json.loads, DEMO_RUN.read_text().splitlines()) if "policy_version" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps after one warm-up step")
    parser.add_argument("--step-s", type=float, default=None, help="a step's wall seconds to compare with "
                        "(default: the recorded demo run's median timing/step_s)")
    args = parser.parse_args()

    from cluster.loop.goodput import GoodputLedger
    from cluster.loop.health import HealthMonitor, StepView
    from cluster.spec import HealthSpec

    rows = _demo_rows()
    step_s = args.step_s or statistics.median(r["timing/step_s"] for r in rows)
    completions = json.loads(COMPLETIONS.read_text())["chain_sum"][:32]
    view = {"response_ids": [c["response_ids"] for c in completions], "texts": [c["text"] for c in completions],
            "finish_reasons": [c["finish_reason"] for c in completions]}
    pools = [_Pool("rollout", 1, 1.0), _Pool("train", 2, 1.0)]
    ledger = GoodputLedger(lambda: (*pools, None, None))
    health = HealthMonitor(HealthSpec(), lambda line: None)
    ledger_s, health_s = [], []
    for step in range(args.steps + 1):
        row = dict(rows[step % len(rows)])
        t0 = time.perf_counter()
        ledger.begin_step()
        for _ in range(WAITS_PER_STEP):
            with ledger.driver.waiting():
                for _ in range(CALLBACKS_PER_STEP):
                    with ledger.driver.working():
                        pass
        row.update(ledger.end_step(sync_s=1.0, trained_tokens=2000))
        t1 = time.perf_counter()
        health.observe(StepView(step + 1, row, **view))
        t2 = time.perf_counter()
        if step:
            ledger_s.append(t1 - t0)
            health_s.append(t2 - t1)
    total = [a + b for a, b in zip(ledger_s, health_s)]
    table = []
    for name, xs in (("goodput ledger", ledger_s), ("health detectors", health_s), ("both", total)):
        mean, p90 = statistics.mean(xs), statistics.quantiles(xs, n=10)[-1]
        table.append([name, 1e3 * mean, 1e3 * p90, f"{100 * mean / step_s:.5f} %"])
    print_table(["part", "mean ms/step", "p90 ms/step", f"% of a {step_s:.1f} s step"], table,
                title=f"goodput and health accounting, {args.steps} steps, demo shape ({len(completions)} completions)")
    print_json("goodput_overhead", {"steps": args.steps, "step_s": step_s,
                                    "mean_s": statistics.mean(total), "share": statistics.mean(total) / step_s,
                                    **load_note()})


if __name__ == "__main__":
    main()
