"""The helpers that put the dashboard and the alert rules to a real Prometheus (``tests/prometheus_checks.py``, used by
``tests/in_process/test_prometheus_real.py``): each check finds what it should on hand-made input."""

from __future__ import annotations

import json

import pytest

from tests.prometheus_checks import (
    grafana_expr,
    grafana_variables,
    implausible,
    panel_queries,
    rules_for_test,
    rules_of,
    selectors,
    shipped_dashboards,
    shipped_rules,
)

DASHBOARD = shipped_dashboards()["grpo-cluster.json"]
RULES = shipped_rules()


def _query(title: str, ref: str):
    return next(q for q in panel_queries(DASHBOARD) if f"{title!r} target {ref}" in q.where)


def test_prometheus_panel_queries_take_unit_and_range_from_defaults_and_overrides():
    assert (_query("Weight sync size and bandwidth", "A").unit, _query("Weight sync size and bandwidth", "B").unit) == (
        "bytes", "short")  # byName override of the GB/s legend
    truncated = _query("Response length", "C")
    assert (truncated.unit, truncated.low, truncated.high) == ("percentunit", 0, 1.0)
    guard = _query("Guard", "A")
    assert (guard.unit, guard.low, guard.high, guard.positive) == ("short", 0, 1, False)
    assert _query("Step time", "A").positive  # a duration: some value > 0
    assert _query("Completions without a reward", "B").unit == "short"  # byRegexp override
    broken = json.loads(json.dumps(DASHBOARD))
    broken["panels"][1]["fieldConfig"]["defaults"]["unit"] = "furlongs"
    with pytest.raises(ValueError, match="furlongs.*UNIT_RANGES"):
        panel_queries(broken)


def test_prometheus_implausible_names_each_problem():
    fraction = _query("Clip fraction", "A")
    assert implausible(fraction, [{"metric": {}, "values": [[1, "0.2"], [2, "0.9"]]}]) is None
    assert implausible(fraction, []) == "no data"
    assert "non-finite" in implausible(fraction, [{"metric": {}, "values": [[1, "NaN"]]}])
    assert "outside the percentunit range" in implausible(fraction, [{"metric": {}, "values": [[1, "1.5"]]}])
    seconds = _query("Step time", "A")
    assert "needs some value > 0" in implausible(seconds, [{"metric": {}, "value": [1, "0"]}])
    assert "outside" in implausible(_query("Step", "A"), [{"metric": {}, "values": [[1, "-1"]]}])  # min 0


def test_prometheus_grafana_expr_fills_variables_and_refuses_unknown_ones():
    variables = grafana_variables("j", 1.0, 60)
    assert variables["__rate_interval"] == "4s" and variables["__range"] == "60s"
    expr = 'label_replace(rate(x{job="$job"}[$__rate_interval]), "c", "$1", "n", "(.+)") + ${job:raw} + [[job]]'
    assert grafana_expr(expr, variables) == 'label_replace(rate(x{job="j"}[4s]), "c", "$1", "n", "(.+)") + j + j'
    with pytest.raises(ValueError, match=r"\$jobname"):
        grafana_expr('x{job="$jobname"}', variables)


def test_prometheus_rules_for_test_drop_for_and_scale_named_thresholds():
    tested = rules_for_test(RULES, {"GRPOJobStalled": ("30 * 60", "12")})
    assert not any("for" in rule for rule in rules_of(tested)) and any("for" in rule for rule in rules_of(RULES))
    stalled = next(rule for rule in rules_of(tested) if rule.get("alert") == "GRPOJobStalled")
    assert stalled["expr"].endswith("> 12")
    with pytest.raises(ValueError, match="expected '45 \\* 60' once"):
        rules_for_test(RULES, {"GRPOJobStalled": ("45 * 60", "12")})
    with pytest.raises(ValueError, match="GRPONoSuchRule.*alerts.yml"):
        rules_for_test(RULES, {"GRPONoSuchRule": ("1", "2")})
    assert "GRPOInfraFailureRate" in {rule.get("alert") for rule in rules_of(RULES)}  # alerts.yml, via its config


def test_prometheus_selectors_are_queries_without_range_or_offset():
    expr = ('avg_over_time(a{worker="driver"}[30m]) >= 1.5 * avg_over_time(a{worker="driver"}[30m] offset 2h) '
            'and on (job) {__name__=~"b_.+",job!="x"}')
    assert selectors(expr) == ['a{worker="driver"}', '{__name__=~"b_.+",job!="x"}']
