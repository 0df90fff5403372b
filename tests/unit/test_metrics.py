"""MetricsLogger: metrics.jsonl lines, console line, Prometheus gauges scraped over HTTP."""

import json
import math
import urllib.request

import pytest

from cluster.metrics import MetricsLogger, format_console_line, prometheus_name, read_metrics_jsonl
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


def test_prometheus_endpoint_on_free_port(tmp_path):
    with MetricsLogger(tmp_path, host="127.0.0.1", port=0, job="unit", echo=False) as metrics:
        assert isinstance(metrics.port, int) and metrics.port > 0
        metrics.log(4, {"reward/mean": 0.25, "sync/verified": True, "policy/kl": math.nan, "note": "text"})
        samples = scrape(f"http://127.0.0.1:{metrics.port}/metrics")
        assert samples['grpo_reward_mean{job="unit"}'] == 0.25
        assert samples['grpo_sync_verified{job="unit"}'] == 1.0
        assert samples['grpo_step{job="unit"}'] == 4.0
        assert math.isnan(samples['grpo_policy_kl{job="unit"}'])
        assert not any(name.startswith("grpo_note") for name in samples)
        metrics.log(5, {"reward/mean": 0.5})
        assert scrape(metrics.url)['grpo_reward_mean{job="unit"}'] == 0.5
        url = metrics.url
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=1)


def test_console_line(tmp_path, capsys):
    with MetricsLogger(tmp_path, port=None) as metrics:
        metrics.log(3, {"reward/mean": 0.125, "reward/accuracy": 0.0625, "actor/kl": 0.0012, "timing/step_s": 44.0,
                        "perf/rollout_tokens_per_s": 152.4, "sync/verified": True, "unlisted": 7})
    assert capsys.readouterr().out.strip() == (
        "step 3 | reward 0.125 acc 0.062 | kl 0.0012 | step 44.0s | 152 tok/s | verified")
    assert format_console_line(1, {"sync/verified": False}) == "step 1 | NOT VERIFIED"
