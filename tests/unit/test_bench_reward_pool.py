"""The reward-pool benchmark's design against noise (``bench/bench_reward_pool.py``, ``bench/_foreign_cpu.py``):
balanced run order, per-variant and paired figures, and the CPU used by processes outside the benchmark (≈ 3 s)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench._foreign_cpu import ForeignCpu
from bench.bench_reward_pool import run_order, summarize

BUSY = "# {tag}\nimport time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_bench_reward_pool_runs_in_balanced_order():
    assert run_order(2) == [(0, "driver"), (0, "pool"), (1, "pool"), (1, "driver")]
    assert run_order(3)[4:] == [(2, "driver"), (2, "pool")]


def _run(variant, repeat, steps, rc=0):
    return {"variant": variant, "repeat": repeat, "rc": rc, "step_s": steps, "score_s": [0.01] * len(steps)}


def test_bench_reward_pool_summary_pairs_the_same_step_of_the_same_repeat():
    runs = [_run("driver", 0, [50.0, 52.0, 60.0]), _run("pool", 0, [51.0, 52.0, 66.0]),
            _run("pool", 1, [55.0, 40.0]), _run("driver", 1, [50.0, 40.0], rc=1)]
    s = summarize(runs)
    driver, pool = s["per_variant"]["driver"], s["per_variant"]["pool"]
    assert (driver["steps"], driver["step_s"]["median"], driver["run_medians"]) == (5, 50.0, [52.0, 45.0])
    assert (pool["steps"], pool["step_s"]["median"], pool["run_medians"]) == (5, 52.0, [52.0, 47.5])
    assert (driver["failed_runs"], pool["failed_runs"]) == (1, 0)
    assert s["ratio"] == pytest.approx(52.0 / 50.0)
    assert s["paired"]["pairs"] == 5
    assert s["paired"]["median"] == pytest.approx(1.02)  # 1.02, 1.0, 1.1, 1.1, 1.0
    assert (s["paired"]["min"], s["paired"]["max"]) == (pytest.approx(1.0), pytest.approx(1.1))


def test_foreign_cpu_counts_other_processes_apart_from_the_benchmarks_own():
    # a process that is not a descendant of this one: started by a shell that exits at once (re-parented)
    foreign_code = BUSY.format(tag="foreign-cpu-test", s=1.5)
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{foreign_code}' >/dev/null 2>&1 &"], check=True)
    with ForeignCpu(interval_s=0.2, top=1000) as foreign:
        subprocess.run([sys.executable, "-c", BUSY.format(tag='own', s=1.5)], check=True)  # the benchmark's own child
        time.sleep(0.5)
    r = foreign.result()
    assert r["own_cpu_s"] >= 0.2 and r["foreign_cpu_s"] >= 0.2, r
    assert any("# foreign-cpu-test" in name for name, _ in r["top"]), r["top"]
    assert not any("# own" in name for name, _ in r["top"]), r["top"]
    assert r["machine_busy_cpu_s"] >= r["own_cpu_s"] and r["wall_s"] >= 1.5
