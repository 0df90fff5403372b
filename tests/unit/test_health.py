"""Health warnings (``cluster.loop.health``, the spec's ``health`` section): each detector fires on an injected case,
none fires on the measured healthy runs (their recorded metrics replayed, and real SmolLM2 completions), the spec's
knobs turn each off, and the registry refuses a second detector of one name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.loop.health import HEALTH_DETECTORS, HealthMonitor, StepView, register_health_detector
from cluster.loop.health_text import garbled_chars, is_looping, loop_tokens
from cluster.spec import HealthSpec, JobSpec
from tests.unit.test_grpo_monitor import LEARN_RUN

REPO = Path(__file__).resolve().parents[2]
#: Real completions of SmolLM2-135M-Instruct sampled as the loop samples them (temperature 1): the demo's chain_sum
#: prompts (128 tokens) and GSM8K prompts (256 tokens); how they were made is in the file's "how" field.
COMPLETIONS = REPO / "tests" / "data" / "completions_smollm2.json"
#: Recorded metrics of healthy runs (docs/results.md): examples/tool_calc_cpu.yaml's 12 steps and the demo's 15.
HEALTHY_RUNS = [REPO / "bench" / "data" / "tool_calc_cpu_12_steps.metrics.jsonl",
                REPO / "bench" / "data" / "demo_cpu_15_steps.metrics.jsonl",  # seed 0 (its 2026-12-05 rerun: identical)
                REPO / "bench" / "data" / "demo_cpu_15_steps_seed1.metrics.jsonl",
                REPO / "bench" / "data" / "demo_cpu_15_steps_seed2.metrics.jsonl"]
DETECTORS = ["repetition", "garbled", "stall", "flat_run", "kl_jump", "entropy_jump", "infra_failures",
             "engine_aborts"]


def _monitor(**fields) -> tuple[HealthMonitor, list[str]]:
    lines: list[str] = []
    return HealthMonitor(HealthSpec(**fields), lines.append), lines


def _feed(monitor: HealthMonitor, rows: list[dict], views: list[dict] | None = None) -> list[dict]:
    views = views or [{}] * len(rows)
    return [monitor.observe(StepView(step, row, **view)) for step, (row, view) in enumerate(zip(rows, views), 1)]


def _healthy_text(i: int) -> list[int]:
    return [1000 + (i * 7 + k * 13) % 500 for k in range(100)]


def test_health_registry_holds_every_detector_and_refuses_a_second_of_one_name():
    assert list(HEALTH_DETECTORS) == DETECTORS
    monitor, _ = _monitor()
    assert list(monitor.detectors) == DETECTORS

    class Again:
        name = "stall"

    with pytest.raises(ValueError, match="already registered"):
        register_health_detector(Again)


# ---- each detector on its injected case ------------------------------------------------------------------------

def test_health_repetition_fires_on_looping_completions():
    loop = [5, 6, 7] + [11, 12, 13, 14] * 20  # a block of 4 tokens repeated 20 times at the end
    assert loop_tokens(loop, 4) == 80 and is_looping(loop, 4, 32)
    assert not is_looping([9] * 3 + list(range(100)), 4, 32) and not is_looping([1, 1, 1, 1, 1], 4, 32)
    monitor, lines = _monitor()
    healthy = [_healthy_text(i) for i in range(24)]
    out = _feed(monitor, [{}, {}], [{"response_ids": healthy + [loop] * 10}, {"response_ids": healthy + [loop] * 8}])
    assert out[0]["health/repetition"] == 1.0 and out[0]["health/value/repetition"] == 10 / 34
    assert out[1]["health/repetition"] == 0.0  # 8 of 32 = 0.25, not above it
    assert len(lines) == 1 and "repetition" in lines[0] and "threshold 0.25" in lines[0] and "10 of 34" in lines[0]


def test_health_garbled_fires_on_replacement_and_control_characters():
    assert garbled_chars("ok \ufffd\ufffd and \x07 \ue000") == 4
    assert garbled_chars("Tab\tnew\nline\r, émoji 🙂, 中文, non\u00a0breaking, zero\u200dwidth") == 0
    monitor, lines = _monitor()
    texts = ["12 + 34 = 46\n#### 46"] * 6 + ["\ufffd\ufffd\x00garbage"] * 2
    out = _feed(monitor, [{}], [{"texts": texts}])
    assert out[0]["health/garbled"] == 1.0 and out[0]["health/value/garbled"] == 0.25
    assert "garbled" in lines[0] and "threshold 0.1" in lines[0]
    one, _ = _monitor()
    assert _feed(one, [{}], [{"texts": ["cut at the cap \ufffd"] + ["fine"] * 3}])[0]["health/garbled"] == 0.0


def test_health_stall_fires_on_a_step_slower_than_three_medians():
    monitor, lines = _monitor()
    rows = [{"timing/step_s": s} for s in (50.0, 52.0, 49.0, 51.0, 160.0, 53.0)]
    out = _feed(monitor, rows)
    assert [o["health/stall"] for o in out] == [0, 0, 0, 0, 1, 0]
    assert "health/value/stall" not in out[2] and out[4]["health/value/stall"] == pytest.approx(160 / 50.5)
    assert "stall" in lines[0] and "timing/step_s 160.0 s" in lines[0] and "threshold 3x" in lines[0]


def test_health_flat_run_fires_on_four_steps_without_signal():
    monitor, lines = _monitor()
    flats = [1.0, 1.0, 1.0, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]
    out = _feed(monitor, [{"groups/all_equal_fraction": f} for f in flats])
    assert [o["health/flat_run"] for o in out] == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert "flat_run" in lines[0] and "4 (threshold 4)" in lines[0]


def test_health_kl_and_entropy_jumps_fire_on_a_spike():
    monitor, lines = _monitor()
    rows = [{"actor/kl": 0.02, "actor/entropy": 2.0}] * 5 + [{"actor/kl": 0.6, "actor/entropy": 2.1},
                                                             {"actor/kl": 0.03, "actor/entropy": 4.5},
                                                             {"actor/kl": 0.03, "actor/entropy": 0.4}]
    out = _feed(monitor, rows)
    assert [o["health/kl_jump"] for o in out] == [0, 0, 0, 0, 0, 1, 0, 0]
    assert [o["health/entropy_jump"] for o in out] == [0, 0, 0, 0, 0, 0, 1, 1]
    assert out[5]["health/value/kl_jump"] == pytest.approx(30.0)
    assert any("kl_jump" in line for line in lines) and any("entropy_jump" in line for line in lines)
    small, _ = _monitor()  # a rise of 0.2 nats, 10x the median: below kl_jump_min_nats, no jump
    assert _feed(small, [{"actor/kl": 0.02}] * 5 + [{"actor/kl": 0.2}])[-1]["health/kl_jump"] == 0.0


def test_health_infra_failures_and_engine_aborts_fire():
    monitor, lines = _monitor()
    rows = [{"reward/infra_failed": 0, "workers/restarts": 0, "rollout/groups_sampled": 4, "rollout/group_size": 8},
            {"reward/infra_failed": 2, "workers/restarts": 0, "rollout/groups_sampled": 4, "rollout/group_size": 8},
            {"reward/infra_failed": 0, "workers/restarts": 1},
            {"reward/infra_failed": 0, "workers/restarts": 1}]
    views = [{"finish_reasons": ["stop"] * 32}, {"finish_reasons": ["stop"] * 32},
             {"finish_reasons": ["stop"] * 32}, {"finish_reasons": ["stop"] * 31 + ["abort"]}]
    out = _feed(monitor, rows, views)
    assert [o["health/infra_failures"] for o in out] == [0, 1, 0, 0]
    assert out[1]["health/value/infra_failures"] == 2 / 32
    assert [o["health/engine_aborts"] for o in out] == [0, 0, 1, 1]  # an engine replaced, then an abort
    assert out[3]["health/value/engine_aborts"] == 1.0 and out[2]["health/warnings"] == 1.0


def test_health_knobs_turn_detectors_off():
    monitor, _ = _monitor(stall_factor=None, kl_jump_factor=None, repetition_max_fraction=None)
    assert set(monitor.detectors) == set(DETECTORS) - {"stall", "kl_jump", "repetition"}
    off, _ = _monitor(enabled=False)
    assert off.observe(StepView(1, {"timing/step_s": 1.0})) == {}
    spec = JobSpec.model_validate({"output_dir": "x", "total_steps": 1, "data": {"train_path": "t.jsonl"},
                                   "health": {"flat_run_steps": None, "garbled_max_fraction": 0.5}})
    assert spec.health.flat_run_steps is None and spec.health.garbled_max_fraction == 0.5
    with pytest.raises(ValueError, match="stall_factor"):
        HealthSpec(stall_factor=1.0)


@pytest.mark.parametrize("section, field", [
    ("health: {enabled: false, stall_factor: 2}", "health.stall_factor"),
    ("health: {enabled: false, garbled_max_fraction: null}", "health.garbled_max_fraction"),
    ("checkpoint: {on_preempt: {enabled: false, deadline_s: 30}}", "checkpoint.on_preempt.deadline_s"),
])
def test_health_and_preempt_settings_that_act_only_when_enabled_are_refused_when_off(tmp_path, section, field):
    """A detector's threshold with every detector off, the preemption deadline with SIGTERM not handled: the user
    believes it acts (cluster.spec.fields.unused_when_off), refused naming the field, the file and its line."""
    from cluster.spec import SpecError, load_spec

    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata: {{train_path: t.jsonl}}\n{section}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert f"{path}:4: {field}: has no effect unless " in message and "enabled: true" in message, message
    assert len(message.splitlines()) == 2
    off = section.replace(", stall_factor: 2", "").replace(", garbled_max_fraction: null", "").replace(
        ", deadline_s: 30", "")
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata: {{train_path: t.jsonl}}\n{off}\n")
    load_spec(path)  # off alone is fine


def test_health_after_a_resume_judges_as_the_uninterrupted_run():
    """A resumed job replays the kept rows of metrics.jsonl: the detectors' history, hence every later value, is the
    uninterrupted run's."""
    rows = [{"policy_version": s, "step": s, "timing/step_s": 50.0 + s, "actor/kl": 0.01 * s,
             "actor/entropy": 2.0 - 0.05 * s, "groups/all_equal_fraction": 1.0, "workers/restarts": 0}
            for s in range(1, 10)]
    whole, _ = _monitor()
    want = [whole.observe(StepView(r["step"], r)) for r in rows]
    resumed, lines = _monitor()
    resumed.observe(StepView(1, {"timing/step_s": 1000.0, "actor/kl": 5.0}))  # what the rollback undid
    resumed.restart([{"step": 0, "eval/accuracy": 0.1}, *rows[:5]])
    assert lines == [] and resumed.warned == dict.fromkeys(DETECTORS, [])
    assert [resumed.observe(StepView(r["step"], r)) for r in rows[5:]] == want[5:]
    assert want[5]["health/flat_run"] == 1.0 and "health/value/stall" in want[5]


# ---- never on the healthy runs -------------------------------------------------------------------------------

def _quiet(rows: list[dict], views: list[dict] | None = None) -> dict[str, list[int]]:
    monitor, _ = _monitor()
    _feed(monitor, rows, views)
    return {name: steps for name, steps in monitor.warned.items() if steps}


@pytest.mark.parametrize("path", HEALTHY_RUNS, ids=lambda p: p.name)
def test_health_quiet_on_the_recorded_healthy_runs(path):
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "policy_version" in r]
    assert len(rows) >= 12
    assert _quiet(rows) == {}


def test_health_quiet_on_the_learning_run_whose_kl_grew_twentyfold():
    rows = [{**row, "groups/all_equal_fraction": 1.0 if row["reward/reasoning_gym"] == 0 else 0.5}
            for step, row in LEARN_RUN if step]
    assert _quiet(rows) == {}


def test_health_quiet_on_real_smollm2_completions():
    data = json.loads(COMPLETIONS.read_text())
    for task in ("chain_sum", "gsm8k"):
        rows = data[task]
        assert len(rows) >= 24
        view = {"response_ids": [r["response_ids"] for r in rows], "texts": [r["text"] for r in rows],
                "finish_reasons": [r["finish_reason"] for r in rows]}
        monitor, lines = _monitor()
        out = monitor.observe(StepView(1, {}, **view))
        assert out["health/warnings"] == 0.0, lines
