"""MetricsLogger: metrics.jsonl lines, console line, Prometheus gauges (job/pool/worker labels) scraped over HTTP."""

import json
import math
import time
import urllib.request

import pytest

from cluster.sinks.metric_names import pool_of, prometheus_name
from cluster.sinks.metrics import MetricsLogger, format_console_line, read_metrics_jsonl
from tests.prometheus_scrape import scrape


def test_prometheus_name():
    assert prometheus_name("reward/mean") == "grpo_reward_mean"
    assert prometheus_name("time/gen-s.x") == "grpo_time_gen_s_x"


def test_jsonl_lines_and_nan_as_null(tmp_path):
    with MetricsLogger(tmp_path / "out", port=None, echo=False) as metrics:
        assert metrics.port is None and metrics.url is None
        metrics.log(1, {"reward/mean": 0.125, "policy/kl": float("nan"), "sync/verified": True, "note": "hi"})
        metrics.log(2, {"reward/mean": 1 / 3})
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.125, "policy/kl": None, "sync/verified": True,
                                    "note": "hi"}
    assert read_metrics_jsonl(tmp_path / "out" / "metrics.jsonl")[1] == {"step": 2, "reward/mean": 1 / 3}


def test_appends_across_loggers(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, port=None, echo=False) as metrics:
            metrics.log(step, {"x": step})
    assert [r["step"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_step_key_is_rejected(tmp_path):
    with MetricsLogger(tmp_path, port=None, echo=False) as metrics, pytest.raises(ValueError, match="'step'"):
        metrics.log(1, {"step": 3})


def _series(name, job="unit", pool="driver", worker="driver"):
    return f'{name}{{job="{job}",pool="{pool}",worker="{worker}"}}'


def test_prometheus_endpoint_on_free_port(tmp_path):
    with MetricsLogger(tmp_path, host="127.0.0.1", port=0, job="unit", echo=False) as metrics:
        assert isinstance(metrics.port, int) and metrics.port > 0
        metrics.log(4, {"reward/mean": 0.25, "sync/verified": True, "policy/kl": math.nan, "note": "text"})
        samples = scrape(f"http://127.0.0.1:{metrics.port}/metrics")
        assert samples[_series("grpo_reward_mean")] == 0.25
        assert samples[_series("grpo_sync_verified", pool="sync")] == 1.0
        assert samples[_series("grpo_step")] == 4.0
        assert math.isnan(samples[_series("grpo_policy_kl")])
        assert not any(name.startswith("grpo_note") for name in samples)
        started = samples[_series("grpo_last_step_timestamp_seconds")]
        assert abs(started - time.time()) < 60
        time.sleep(0.01)
        metrics.log(5, {"reward/mean": 0.5})
        samples = scrape(metrics.url)
        assert samples[_series("grpo_reward_mean")] == 0.5
        assert samples[_series("grpo_last_step_timestamp_seconds")] > started
        url = metrics.url
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=1)


@pytest.mark.parametrize("key, pool", [
    ("actor/kl", "train"), ("actor/clip_fraction", "train"), ("perf/train_tokens_per_s", "train"),
    ("timing/train_s", "train"), ("timing/train_compute_s", "train"), ("packing/padding_fraction", "train"),
    ("memory/train_peak_rss_gib", "train"),
    ("rollout/staleness_max", "rollout"), ("rollout/queue_depth", "rollout"), ("rollout/kv_cache_usage", "rollout"),
    ("response_length/mean", "rollout"), ("perf/rollout_tokens_per_s", "rollout"), ("timing/generate_s", "rollout"),
    ("sync/bytes", "sync"), ("sync/verified", "sync"), ("timing/sync_s", "sync"),
    ("step", "driver"), ("policy_version", "driver"), ("reward/mean", "driver"), ("groups/all_equal_fraction",
                                                                                   "driver"),
    ("workers/restarts", "driver"), ("timing/step_s", "driver"), ("timing/score_s", "driver"),
])
def test_pool_of_key(key, pool):
    assert pool_of(key) == pool


def test_issue_figures_have_stable_prometheus_names():
    """The names the dashboard and alert rules in deploy/ query (tests/unit/test_deploy.py checks them)."""
    assert {k: prometheus_name(k) for k in ("workers/restarts", "rollout/staleness_max", "rollout/staleness_mean",
                                            "policy_version", "timing/sync_s", "sync/bytes", "rollout/queue_depth",
                                            "rollout/kv_cache_usage")} == {
        "workers/restarts": "grpo_workers_restarts", "rollout/staleness_max": "grpo_rollout_staleness_max",
        "rollout/staleness_mean": "grpo_rollout_staleness_mean", "policy_version": "grpo_policy_version",
        "timing/sync_s": "grpo_timing_sync_s", "sync/bytes": "grpo_sync_bytes",
        "rollout/queue_depth": "grpo_rollout_queue_depth", "rollout/kv_cache_usage": "grpo_rollout_kv_cache_usage"}


def test_per_worker_series_beside_the_aggregate(tmp_path):
    with MetricsLogger(tmp_path, port=0, job="unit", echo=False) as metrics:
        metrics.log(3, {"perf/rollout_tokens_per_s": 150.0, "rollout/queue_depth": 3, "workers/restarts": 1})
        for i, (tps, depth) in enumerate([(100.0, 2), (50.0, 1)]):
            metrics.log_worker(3, "rollout", f"rollout-{i}", {"perf/rollout_tokens_per_s": tps,
                                                              "rollout/queue_depth": depth,
                                                              "rollout/kv_cache_usage": 0.25 * (i + 1),
                                                              "workers/restarts": i, "engine": "vllm"})
        metrics.log_worker(3, "train", "train-0", {"workers/restarts": 0})
        samples = scrape(metrics.url)
        assert samples[_series("grpo_perf_rollout_tokens_per_s", pool="rollout")] == 150.0
        assert samples[_series("grpo_perf_rollout_tokens_per_s", pool="rollout", worker="rollout-0")] == 100.0
        assert samples[_series("grpo_perf_rollout_tokens_per_s", pool="rollout", worker="rollout-1")] == 50.0
        assert samples[_series("grpo_rollout_queue_depth", pool="rollout", worker="rollout-1")] == 1.0
        assert samples[_series("grpo_rollout_kv_cache_usage", pool="rollout", worker="rollout-1")] == 0.5
        assert samples[_series("grpo_workers_restarts")] == 1.0
        assert samples[_series("grpo_workers_restarts", pool="train", worker="train-0")] == 0.0
        assert not any(name.startswith("grpo_engine") for name in samples)
        assert metrics.remove_worker("rollout", "rollout-1") == 4
        assert metrics.remove_worker("rollout", "rollout-1") == 0
        after = scrape(metrics.url)
        assert not any('worker="rollout-1"' in name for name in after)
        assert after[_series("grpo_rollout_queue_depth", pool="rollout", worker="rollout-0")] == 2.0
    rows = read_metrics_jsonl(tmp_path / "workers.jsonl")
    assert [(r["step"], r["pool"], r["worker"]) for r in rows] == [(3, "rollout", "rollout-0"),
                                                                 (3, "rollout", "rollout-1"), (3, "train", "train-0")]
    assert rows[0]["engine"] == "vllm"
    assert [r["step"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")] == [3]


@pytest.mark.parametrize("pool, worker, metrics, match", [
    ("decode", "w0", {"x": 1}, "pool must be one of"),
    ("rollout", "driver", {"x": 1}, "reserved"),
    ("rollout", "", {"x": 1}, "non-empty"),
    ("rollout", "w0", {"worker": "w1"}, r"\['worker'\]"),
])
def test_log_worker_rejects_bad_arguments(tmp_path, pool, worker, metrics, match):
    with MetricsLogger(tmp_path, port=None, echo=False) as logger, pytest.raises(ValueError, match=match):
        logger.log_worker(1, pool, worker, metrics)
    assert not (tmp_path / "workers.jsonl").exists()


def test_console_line(tmp_path, capsys):
    # Keys given in reverse of the layout, plus one that is not in it. Expected, by the layout in CONSOLE_FIELDS
    # (groups in its order joined by " | ", keys absent from the step left out, unlisted keys never shown):
    # reward 0.1234 → 3 decimals "0.123"; accuracy 0.0626 → "0.063"; kl 0.00123 → 4 decimals "0.0012";
    # step 43.96 s → 1 decimal "44.0s"; 152.6 tok/s → 0 decimals "153"; verified True → "verified".
    metrics = {"sync/verified": True, "perf/rollout_tokens_per_s": 152.6, "timing/step_s": 43.96, "unlisted": 7,
               "actor/kl": 0.00123, "reward/accuracy": 0.0626, "reward/mean": 0.1234}
    expected = "step 3 | reward 0.123 acc 0.063 | kl 0.0012 | step 44.0s | 153 tok/s | verified"
    with MetricsLogger(tmp_path, port=None) as logger:
        logger.log(3, metrics)
    assert capsys.readouterr().out.strip() == expected
    assert format_console_line(3, metrics) == expected
    assert format_console_line(1, {"sync/verified": False}) == "step 1 | NOT VERIFIED"
    assert format_console_line(2, {}) == "step 2"
    assert format_console_line(2, {"policy_version": 5.0, "response_length/mean": 95.7}) == "step 2 | v5 | len 96"
    assert format_console_line(2, {"reward/mean": "n/a"}) == "step 2 | reward/mean n/a"  # not a number: as given


def test_console_line_shows_the_reward_components():
    """An agent's step: its total (``reward/agent``, the reward itself) and the driver's summaries are not components;
    every other ``reward/<name>`` is, named after acc/fmt, the first CONSOLE_COMPONENTS by name, then a count."""
    from cluster.sinks.metrics import CONSOLE_COMPONENTS

    agent = {"reward/mean": 0.125, "reward/agent": 0.125, "reward/accuracy": 0.0, "reward/tool_use": 0.5,
             "reward/brevity": 0.25, "reward/std": 0.3, "reward/none_fraction": 0.0, "reward/failed": 0,
             "reward/scored/tool_use": 8, "reward/note": "text", "groups/all_equal_fraction": 0.5}
    assert format_console_line(4, agent) == "step 4 | reward 0.125 acc 0.000 brevity 0.250 tool_use 0.500 flat 0.50"
    many = {"reward/mean": 1.0, **{f"reward/part_{i}": i / 10 for i in range(CONSOLE_COMPONENTS + 2)}}
    shown = " ".join(f"part_{i} {i / 10:.3f}" for i in range(CONSOLE_COMPONENTS))
    assert format_console_line(1, many) == f"step 1 | reward 1.000 {shown} +2 more"


def test_stall_timestamp_is_set_before_the_first_step(tmp_path):
    """GRPOJobStalled (deploy/prometheus/alerts.yml) also covers a job that never completes step 1."""
    with MetricsLogger(tmp_path, port=None, job="unit", echo=False) as metrics:
        value = metrics.registry.get_sample_value("grpo_last_step_timestamp_seconds",
                                                  {"job": "unit", "pool": "driver", "worker": "driver"})
        assert value is not None and abs(value - time.time()) < 60
        assert metrics.registry.get_sample_value("grpo_step", {"job": "unit", "pool": "driver",
                                                               "worker": "driver"}) is None
