"""What a real Prometheus is asked about deploy/: every Grafana panel target as Grafana would send it, whether its
answer is plausible for the panel's unit, and the alert rules as the test's server loads them.

- :func:`panel_queries`: every target of every data panel (collapsed rows included) with its unit and range, read from
  the panel's ``fieldConfig`` (``defaults``, and ``byName``/``byRegexp`` overrides of the target's legend).
- :func:`grafana_expr`: a target's ``expr`` with Grafana's variables replaced (``$job``, ``${job}``, ``[[job]]``,
  ``$__interval``, ``$__rate_interval``, ``$__range``...); an unknown variable raises.
- :func:`implausible`: what is wrong with a query's answer for its unit (:data:`UNIT_RANGES`), or None.
- :func:`shipped_dashboards`, :func:`shipped_rules`: every dashboard of ``deploy/grafana/`` and every rule file
  ``deploy/prometheus/prometheus.yml`` loads, so that new ones are checked too.
- :func:`rules_for_test`: the rule files with ``for:`` dropped and named thresholds scaled to test time.
- :func:`selectors`: each series selector of a PromQL expression, on its own (no range, no offset).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import promql_parser
import yaml

from tests.deploy_checks import DEPLOY

#: Grafana unit → (lowest, highest plausible value, must some value be > 0). A unit not listed here fails the test
#: (add it with its range). A panel's own ``min``/``max`` replace the unit's bounds.
UNIT_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "percentunit": (0.0, 1.0, False),  # a fraction 0..1
    "s": (0.0, None, True),  # a duration or an age: >= 0, and a step takes time
    "bytes": (0.0, None, True),  # a size: >= 0, and a sync sends something
    "short": (None, None, False),  # a plain number: finite, in the panel's min/max when it sets them
}

_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


@dataclass(frozen=True)
class PanelQuery:
    """One target of a dashboard panel.

    Attributes:
        where: ``panel <id> '<title>' target <refId>``, for messages. expr: the PromQL as written (variables in it).
        unit: the Grafana unit that applies to the target's series. low, high: plausible bounds (None: unbounded).
        positive: some value must be > 0. instant: Grafana sends it as an instant query (else a range query).
    """

    where: str
    panel_id: int
    expr: str
    unit: str
    low: float | None
    high: float | None
    positive: bool
    instant: bool


def shipped_dashboards() -> dict[str, dict]:
    """Every Grafana dashboard of ``deploy/grafana/``, by file name."""
    return {path.name: json.loads(path.read_text()) for path in sorted((DEPLOY / "grafana").glob("*.json"))}


def shipped_rules() -> dict[str, dict]:
    """Every rule file ``deploy/prometheus/prometheus.yml`` loads (``rule_files``, beside it), by name."""
    folder = DEPLOY / "prometheus"
    config = yaml.safe_load((folder / "prometheus.yml").read_text())
    return {name: yaml.safe_load((folder / name).read_text()) for name in config.get("rule_files", [])}


def data_panel_ids(dashboard: dict) -> set[int]:
    """Ids of the panels that show data (every panel but rows; collapsed rows' panels included)."""
    return {p["id"] for p in _panels(dashboard) if p.get("type") != "row"}


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _field_config(panel: dict, legend: str) -> dict:
    """The panel's ``fieldConfig.defaults`` with the overrides that match ``legend`` applied: ``byName`` (equal) and
    ``byRegexp`` (Grafana tests the regex anywhere in the name)."""
    config = dict(panel.get("fieldConfig", {}).get("defaults", {}))
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        kind, pattern = override.get("matcher", {}).get("id"), override.get("matcher", {}).get("options", "")
        if kind == "byName" and pattern == legend or kind == "byRegexp" and re.search(pattern, legend):
            config.update({p["id"]: p.get("value") for p in override.get("properties", [])})
    return config


def panel_queries(dashboard: dict, name: str = "dashboard") -> list[PanelQuery]:
    """Every target of every data panel of ``dashboard`` (``name``: its file, for messages).

    Raises:
        ValueError: a target's unit is not in :data:`UNIT_RANGES` (naming the panel).
    """
    out = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            where = f"{name}: panel {panel.get('id')} {panel.get('title')!r} target {target.get('refId')}"
            config = _field_config(panel, target.get("legendFormat", ""))
            unit = config.get("unit", "short")
            if unit not in UNIT_RANGES:
                raise ValueError(f"{where}: unit {unit!r} has no plausible range in tests/prometheus_checks.py "
                                 f"UNIT_RANGES (known: {sorted(UNIT_RANGES)}): add one")
            low, high, positive = UNIT_RANGES[unit]
            out.append(PanelQuery(where, panel.get("id"), target["expr"], unit, config.get("min", low),
                                  config.get("max", high), positive, bool(target.get("instant"))))
    return out


def grafana_variables(job: str, scrape_s: float, range_s: float) -> dict[str, str]:
    """What Grafana puts in for its variables when it shows ``job`` over a ``range_s``-second range of data scraped
    every ``scrape_s`` seconds: ``$__interval`` the scrape interval (the data source's minimum), ``$__rate_interval``
    max(4 × scrape, interval + scrape) (Grafana's definition), ``$__range`` the range."""
    interval = f"{scrape_s:g}s"
    return {"job": job, "__interval": interval, "__interval_ms": f"{scrape_s * 1000:g}",
            "__rate_interval": f"{max(4 * scrape_s, 2 * scrape_s):g}s", "__range": f"{range_s:.0f}s",
            "__range_s": f"{range_s:.0f}", "__range_ms": f"{range_s * 1000:.0f}"}


def grafana_expr(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with ``$name``, ``${name}``, ``${name:format}`` and ``[[name]]`` replaced from ``variables``
    (Grafana's template syntax).

    Raises:
        ValueError: a variable ``variables`` does not hold.
    """
    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in variables:
            raise ValueError(f"Grafana variable ${name} in {expr!r} has no test value (known: {sorted(variables)})")
        return variables[name]

    name = r"([A-Za-z_]\w*)"  # not $1, $2: label_replace's capture groups, which Grafana leaves alone
    return re.sub(rf"\$\{{{name}(?::\w+)?\}}|\[\[{name}\]\]|\${name}", value, expr)


def implausible(query: PanelQuery, series: list[dict]) -> str | None:
    """What is wrong with ``series`` (a range or instant query's result) as data for ``query``'s panel: no series,
    a value that is not finite, outside ``[low, high]``, or no value > 0 where one must be; None when plausible."""
    values = [float(v) for s in series for _, v in (s.get("values") or [s["value"]])]
    if not values:
        return "no data"
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        return f"{len(bad)} non-finite value(s), e.g. {bad[0]}"
    low, high = min(values), max(values)
    if query.low is not None and low < query.low or query.high is not None and high > query.high:
        return f"values in [{low:g}, {high:g}], outside the {query.unit} range [{query.low}, {query.high}]"
    if query.positive and high <= 0:
        return f"every value is {high:g}; a {query.unit} panel needs some value > 0"
    return None


def rules_for_test(files: Mapping[str, dict], scaled: Mapping[str, tuple[str, str]]) -> dict[str, dict]:
    """The rule files (name → parsed YAML) as the test's server loads them: every ``for:`` dropped (a condition
    fires at its first evaluation; ``alerts_test.yml`` checks the durations with promtool) and, for each rule named in
    ``scaled``, its ``expr`` text ``old`` replaced by ``new`` (a threshold in minutes made seconds).

    Raises:
        ValueError: a scaled rule is in no file, or its ``old`` text does not occur exactly once in its expr.
    """
    out, found = copy.deepcopy(dict(files)), set()
    for rule in rules_of(out):
        rule.pop("for", None)
        name = rule.get("alert") or rule.get("record")
        if name in scaled:
            old, new = scaled[name]
            if rule["expr"].count(old) != 1:
                raise ValueError(f"rule {name}: expected {old!r} once in its expr to scale it for the test, got "
                                 f"{rule['expr']!r}; update the test's scaled thresholds")
            rule["expr"] = rule["expr"].replace(old, new)
            found.add(name)
    if set(scaled) - found:
        raise ValueError(f"rules {sorted(set(scaled) - found)} to scale are in none of {sorted(files)}")
    return out


def rules_of(files: Mapping[str, dict]) -> list[dict]:
    """Every rule of the rule files (name → parsed YAML), in order (alerting and recording)."""
    return [rule for doc in files.values() for group in doc["groups"] for rule in group["rules"]]


def selectors(expr: str) -> list[str]:
    """Each series selector of ``expr`` as a query of its own, without its range or offset (``x{a="b"}[15m]
    offset 2h`` → ``x{a="b"}``), in order, without repeats."""
    out: list[str] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [f"{m.name}{_OPS[str(m.op)]}{json.dumps(m.value)}" for m in node.matchers.matchers]
            text = f"{node.name or ''}{{{','.join(matchers)}}}"
            if text not in out:
                out.append(text)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return out
