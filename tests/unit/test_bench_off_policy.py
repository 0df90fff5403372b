"""bench/bench_off_policy.py: every variant's overrides make a valid spec on both runtimes' examples, with the
correction the variant names, and a run's row is read from its metrics.jsonl as documented (steps 2..N; the
weight range is the ratio range truncated at the cap, only for a run whose correction is on)."""

from __future__ import annotations

import json
import math

import pytest

from bench.bench_modes import DEMO, MODES, mode_overrides
from bench.bench_off_policy import IN_PROCESS, TINY_SPEC, VARIANTS, correction_overrides, summarize
from cluster.spec import load_spec
from cluster.spec.algorithm import effective_algorithm


@pytest.fixture(scope="module")
def parity():
    from tests.registered import parity_reward, temporarily_registered

    yield from temporarily_registered("parity", parity_reward)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_is_a_valid_spec_with_its_correction(tmp_path, parity, variant):
    mode, correction = VARIANTS[variant]
    demo = load_spec(DEMO, mode_overrides(mode, 4, tmp_path / "r", [0], [1], correction_overrides(correction)))
    tiny = load_spec(TINY_SPEC, [*IN_PROCESS, f"output_dir={tmp_path}", *MODES[mode],
                                 *correction_overrides(correction)])
    for spec in (demo, tiny):
        run = effective_algorithm(spec.algorithm, spec.rollout)
        assert spec.rollout.mode == mode.split("+")[0]
        assert run.tis_cap == (2.0 if correction == "default" and mode != "sync" else None)


def test_summary_reads_steps_after_the_first(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    for step, (diff, lo, hi, weight, kl) in enumerate(
            [(1e-7, 1.0, 1.0, 1.0, 0.0), (0.1, 0.5, 3.0, 1.1, 0.02), (0.2, 0.7, 1.5, 0.9, 0.04)], start=1):
        rows.append({"step": step, "reward/mean": 0.5, "rollout/logprob_diff": diff, "actor/behaviour_ratio_min": lo,
                     "actor/behaviour_ratio_max": hi, "actor/tis_weight_mean": weight,
                     "actor/kl_behaviour_current": kl})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = summarize(path, "async/default")
    assert row["steps"] == 3 and row["logprob_diff_mean"] == pytest.approx(0.15) and row["logprob_diff_max"] == 0.2
    assert (row["ratio_min"], row["ratio_max"], row["weight_min"], row["weight_max"]) == (0.5, 3.0, 0.5, 2.0)
    assert row["tis_weight_mean"] == pytest.approx(1.0) and row["kl_max"] == 0.04
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "actor/tis_weight_mean"}) + "\n"
                            for r in rows))
    unweighted = summarize(path, "async/none")
    assert math.isnan(unweighted["weight_min"]) and math.isnan(unweighted["tis_weight_mean"])
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="has 1 training steps"):
        summarize(path, "sync/none")
