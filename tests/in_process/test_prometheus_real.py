"""The dashboard and the alert rules against a real Prometheus: Debian's ``prometheus`` server (the package that ships
``promtool``) scrapes real jobs of the in-process runtime on loopback every second, with the rule files
``deploy/prometheus/prometheus.yml`` loads; every panel target of every dashboard in ``deploy/grafana/`` and every
rule is asked through Prometheus's HTTP API. Skipped, with the reason, where the binary is missing (≈ 35 s here, most
of it the stall below).

One server, two jobs one after the other (their ports drawn before the server starts, from this pytest-xdist
worker's share of the port range), one test that reports every problem found (so that pytest-xdist never splits the
module and starts all of it twice):

- ``healthy``: the demo (``examples/demo_cpu.yaml``) shrunk to the tiny random Llama: 4 steps of 2 prompts × 4,
  held-out evaluation at start and end, its guard with ``action: rollback`` (so the rollback series exist; nothing
  trips), and the ``parity`` test reward beside the task's own (a random model never solves a task; parity gives its
  groups a learning signal). Every panel target must show plausible data for it; every rule must stay quiet.
- ``faults``: a tiny job whose reward (``tests.reward_faults.parity_with_gaps``) leaves a quarter of the completions
  unscored (an infrastructure-failure rate), whose guard has a hair trigger (``entropy_band`` trips at step 3,
  ``action: warn``), and whose step 4 hangs in its reward call (a stalled step) until the alerts of :data:`INJECTED`
  fired, or :data:`STALL_DEADLINE_S` passed.

The server's copy of the rules (``tests.prometheus_checks.rules_for_test``) drops ``for:`` (``alerts_test.yml``
checks the durations with promtool) and scales GRPOJobStalled's 30 minutes to :data:`STALL_S` seconds; the healthy
job is also checked against the rules exactly as written. New panels and rules are picked up from the files; a rule
on a series neither job exports fails here until a job of this module exports it.

Run it alone: ``PYTHONPATH=$PWD .venv/bin/python -m pytest tests/in_process -k prometheus``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests import reward_faults
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.prometheus_checks import (
    grafana_expr,
    grafana_variables,
    implausible,
    panel_queries,
    data_panel_ids,
    rules_for_test,
    rules_of,
    selectors,
    shipped_dashboards,
    shipped_rules,
)
from tests.prometheus_server import PrometheusServer, missing_reason
from tests.reference_job import REPO
from tests.registered import temporarily_registered

DEPLOY = REPO / "deploy"
DASHBOARDS = shipped_dashboards()
RULES = shipped_rules()
SCRAPE_S = 1.0
STALL_S = 12
STALL_DEADLINE_S = 60.0
#: Rule → (text of its expr, what the test's server uses instead): thresholds too long to wait for.
SCALED = {"GRPOJobStalled": ("30 * 60", str(STALL_S))}
#: Alert → the condition of the ``faults`` job that must make it fire.
INJECTED = {"GRPOJobStalled": "step 4 hangs in its reward call", "GRPOGuardTripped": "entropy_band trips at step 3",
            "GRPOGuardDetector": "entropy_band trips at step 3",
            "GRPOInfraFailureRate": "a quarter of the completions get no reward",
            "GRPOHealthWarning": "a quarter of the completions get no reward (health infra_failures)"}
HEALTHY_STEPS, FAULT_STEPS, TRIP_STEP = 4, 4, 3
#: A target the dashboard once had: the driver never logs a pool-wide queue depth (only each engine does).
NEVER_EXPORTED = 'grpo_rollout_queue_depth{job="$job",worker="driver"}'


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    """Loopback ports of the server and of each job's metrics endpoint, from this xdist worker's share."""
    from weight_sync.group import free_ports

    return dict(zip(("prometheus", "healthy", "faults"), free_ports(3)))


@pytest.fixture(scope="module")
def prometheus(ports, tmp_path_factory):
    """The server, scraping both jobs' ports with the driver job of ``deploy/prometheus/prometheus.yml``
    (``honor_labels``: series keep the spec's name as ``job``), once it has tried both targets."""
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    shipped = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    driver = next(s for s in shipped["scrape_configs"] if s["job_name"] == "grpo-driver")
    driver["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job]}" for job in ("healthy", "faults")]}]
    config = {"global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
              "scrape_configs": [driver]}
    rules = {name: yaml.safe_dump(doc, sort_keys=False) for name, doc in rules_for_test(RULES, SCALED).items()}
    with PrometheusServer.started(tmp_path_factory.mktemp("prometheus"), config, rules, ports["prometheus"]) as server:
        server.wait_for_targets(2)
        yield server


def _run(job, prom: PrometheusServer, steps: int) -> tuple[float, float]:
    """Run ``job`` to its end and keep its endpoint up until Prometheus scraped the last step; returns the window
    (start, end) of Unix times that holds its whole run as Prometheus saw it."""
    start = time.time()
    with stopped_after(job):
        job.run()
        deadline = time.time() + 10
        while not prom.query(f'grpo_step{{job="{job.spec.name}",worker="driver"}} == {steps}'):
            assert time.time() < deadline, f"Prometheus never scraped step {steps} of {job.spec.name}"
            time.sleep(0.2)
        end = time.time()
    return start, end


@pytest.fixture(scope="module")
def healthy(prometheus, ports, tiny_model_dir, parity_registered, tmp_path_factory):
    from cluster.in_process import local_job
    from cluster.spec import load_spec

    out = tmp_path_factory.mktemp("healthy")
    spec = load_spec(REPO / "examples" / "demo_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"output_dir={out}", f"total_steps={HEALTHY_STEPS}", "resume=never",
        "data.reasoning_gym.size=32", "data.reasoning_gym.held_out_size=4", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_response_tokens=8", "train.world_size=1", "eval.max_tokens=8",
        'algorithm.rewards={"reasoning_gym": 1.0, "parity": 1.0}', "monitor.action=rollback",
        "checkpoint.every_steps=2", "checkpoint.save_final=false", f"metrics.port={ports['healthy']}"])
    start, end = _run(local_job(spec, progress=False), prometheus, HEALTHY_STEPS)
    return {"job": spec.name, "start": start, "end": end}


def _write_problems(path: Path, count: int) -> str:
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _firing(prom: PrometheusServer, job: str) -> set[str]:
    return {a["labels"]["alertname"] for a in prom.alerts() if a["state"] == "firing" and a["labels"].get("job") == job}


@pytest.fixture(scope="module")
def gaps_registered():
    yield from temporarily_registered("parity_with_gaps", reward_faults.parity_with_gaps)


@pytest.fixture(scope="module")
def faults(prometheus, ports, healthy, tiny_model_dir, gaps_registered, tmp_path_factory):
    """The faults job, after the healthy one (its series are stale by then)."""
    from cluster.in_process import local_job
    from cluster.sinks.metrics import read_metrics_jsonl

    out, name = tmp_path_factory.mktemp("faults"), "prometheus_faults"
    spec = local_spec(
        tiny_model_dir, str(out), name=name, total_steps=FAULT_STEPS,
        data={"train_path": _write_problems(out / "train.jsonl", 16), "max_prompt_tokens": 256},
        algorithm={"rewards": {"accuracy": 1.0, "format": 0.2, "parity_with_gaps": 1.0}},
        monitor={"action": "warn", "detectors": ["entropy_band"], "baseline_steps": 2, "window_steps": 1,
                 "entropy_drop_frac": 1e-9, "entropy_rise_frac": 1e-9},
        metrics={"port": ports["faults"]}, checkpoint={"every_steps": 0, "save_final": False})
    at_release: set[str] = set()

    def all_fired() -> bool:
        at_release.clear()
        at_release.update(_firing(prometheus, name))
        return set(INJECTED) <= at_release

    def trip_logged() -> bool:  # the stall: the first reward call after step TRIP_STEP's row (step TRIP_STEP + 1)
        path = out / "metrics.jsonl"
        return path.is_file() and any(r["step"] == TRIP_STEP for r in read_metrics_jsonl(path))

    gate = reward_faults.STALL
    gate.arm(when=trip_logged, until=all_fired, deadline_s=STALL_DEADLINE_S)
    try:
        start, end = _run(local_job(spec, progress=False), prometheus, FAULT_STEPS)
    finally:
        gate.disarm()
    return {"job": name, "start": start, "end": end, "stall": gate.stalled, "firing": at_release,
            "rows": read_metrics_jsonl(out / "metrics.jsonl")}


def test_prometheus_missing_binary_is_a_skip_reason(tmp_path):
    reason = missing_reason(path=str(tmp_path))
    assert reason is not None and "prometheus" in reason and "install_test_tools.sh" in reason


def _scrape_problems(prom: PrometheusServer, ports: dict[str, int], healthy: dict) -> list[str]:
    """The job's endpoint was up and scraped under the spec's name; every rule loaded and evaluates."""
    problems = []
    up = prom.query_range(f'up{{instance="127.0.0.1:{ports["healthy"]}"}}', healthy["start"], healthy["end"])
    if not up or max(float(v) for _, v in up[0]["values"]) != 1.0:
        problems.append(f"the healthy job's endpoint was never up: {up}")
    if not prom.query(f'grpo_step{{job="{healthy["job"]}",worker="driver"}}', at=healthy["end"]):
        problems.append(f"no grpo_step series labelled job={healthy['job']!r} (honor_labels?)")
    loaded = prom.rules()
    problems += [f"rule {r['name']}: {r['health']}: {r['lastError']}" for r in loaded if r["health"] != "ok"]
    missing = {r.get("alert") or r["record"] for r in rules_of(RULES)} - {r["name"] for r in loaded}
    return problems + [f"rule {name} not loaded" for name in sorted(missing)]


def _variable_problems(prom: PrometheusServer, healthy: dict) -> list[str]:
    """Each query variable of each dashboard (``label_values(selector, label)``) offers the job."""
    problems = []
    for name, dashboard in DASHBOARDS.items():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            selector, label = variable["definition"].removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
            if healthy["job"] not in prom.label_values(label.strip(), selector):
                problems.append(f"{name}: ${variable['name']} ({variable['definition']}) does not offer the job")
    return problems


def _panel_problems(prom: PrometheusServer, healthy: dict) -> list[str]:
    """Every target of every panel, its variables filled in as Grafana would, over the healthy job's run: data,
    plausible for the panel's unit and min/max (``tests.prometheus_checks.UNIT_RANGES``); and the check itself
    refuses a target on a series no job exports."""
    start, end = healthy["start"], healthy["end"]
    variables = grafana_variables(healthy["job"], SCRAPE_S, end - start)
    problems = []
    for name, dashboard in DASHBOARDS.items():
        queries = panel_queries(dashboard, name)
        for q in queries:
            expr = grafana_expr(q.expr, variables)
            series = prom.query(expr, at=end) if q.instant else prom.query_range(expr, start, end)
            if (problem := implausible(q, series)) is not None:
                problems.append(f"{q.where}: {expr}: {problem}")
        targeted = {q.panel_id for q in queries}
        problems += [f"{name}: panel {i} has no target" for i in sorted(data_panel_ids(dashboard) - targeted)]
    if implausible(q, prom.query_range(grafana_expr(NEVER_EXPORTED, variables), start, end)) != "no data":
        problems.append(f"the panel check accepted {NEVER_EXPORTED}, which no job exports")
    return problems


def _quiet_problems(prom: PrometheusServer, healthy: dict) -> list[str]:
    """Each alert's expression, as written and as the server runs it, selects nothing of the healthy job over its
    run, and the server's rule manager raised no alert for it."""
    start, end, job = healthy["start"], healthy["end"], healthy["job"]
    problems = []
    for written, tested in zip(rules_of(RULES), rules_of(rules_for_test(RULES, SCALED))):
        for rule in (written, tested):
            if "alert" in rule:
                hits = [s for s in prom.query_range(rule["expr"], start, end) if s["metric"].get("job") == job]
                problems += [f"{rule['alert']}: {rule['expr']!r} -> {s['metric']} {s['values'][:3]}" for s in hits]
    alerts = prom.query_range(f'ALERTS{{job="{job}"}}', start, end + 2)
    return problems + [f"the rule manager raised {a['metric']}" for a in alerts]


def _series_problems(prom: PrometheusServer, since: float) -> list[str]:
    """Every series selector of every rule has data from one of the jobs (a rule on a series no job exports can
    never fire); a recording rule's expression and its recorded series have data too."""
    window = f"{time.time() - since + 5:.0f}s"
    problems = []
    for rule in rules_of(RULES):
        name = rule.get("alert") or rule["record"]
        queries = [f"count_over_time({s}[{window}])" for s in selectors(rule["expr"])]
        if "record" in rule:  # the expression (a subquery over the window) and the series it records
            queries += [f"count_over_time(({rule['expr']})[{window}:{SCRAPE_S:g}s])",
                        f"count_over_time({rule['record']}[{window}])"]
        problems += [f"{name}: no data from either job for {query}" for query in queries if not prom.query(query)]
    return problems


def _fault_problems(prom: PrometheusServer, faults: dict) -> list[str]:
    """The faults were injected as planned, and each alert of :data:`INJECTED` fired in the rule manager on the
    job's scraped series; the stall alert not before the stall, the detector alert naming entropy_band."""
    rows, job = {r["step"]: r for r in faults["rows"]}, faults["job"]
    tripped = [rows[s]["monitor/tripped"] for s in range(1, TRIP_STEP + 1)]
    if tripped != [0.0] * (TRIP_STEP - 1) + [1.0]:
        return [f"the guard should trip at step {TRIP_STEP} alone, monitor/tripped was {tripped}"]
    if any(r["reward/none_fraction"] != 1 / reward_faults.GAP_EVERY for r in rows.values()):
        return [f"reward/none_fraction should be 1/{reward_faults.GAP_EVERY} on every step: {rows}"]
    if faults["stall"] is None:
        return ["the reward call of the stalled step never came"]
    stall_start, stall_end = faults["stall"]
    problems = [f"{name} ({why}) not firing after {stall_end - stall_start:.0f} s of stall; firing: "
                f"{sorted(faults['firing'])}" for name, why in INJECTED.items() if name not in faults["firing"]]
    step, last = (float(prom.query(f'{q}{{job="{job}",worker="driver"}}', at=stall_end)[0]["value"][1])
                  for q in ("grpo_step", "grpo_last_step_timestamp_seconds"))
    if step != TRIP_STEP or stall_end - last < STALL_S:
        problems.append(f"at the stall's end step {step:g} (expected {TRIP_STEP}), {stall_end - last:.1f} s since "
                        f"the last step (expected >= {STALL_S})")
    if early := prom.query_range(f'ALERTS{{alertname="GRPOJobStalled",job="{job}"}}', faults["start"], stall_start):
        problems.append(f"GRPOJobStalled fired before the stall: {early}")
    detectors = prom.query(f'ALERTS{{alertname="GRPOGuardDetector",job="{job}"}}', at=stall_end)
    if {a["metric"]["detector"] for a in detectors} != {"entropy_band"}:
        problems.append(f"GRPOGuardDetector should name entropy_band alone: {detectors}")
    return problems


def test_prometheus_real_scrape_checks_every_panel_and_alert_rule(prometheus, ports, healthy, faults):
    """Every check of the module docstring on the server's data, reported together."""
    problems = {
        "scrape and rules": _scrape_problems(prometheus, ports, healthy),
        "dashboard variables": _variable_problems(prometheus, healthy),
        "dashboard panels on the healthy demo": _panel_problems(prometheus, healthy),
        "alerts on the healthy demo": _quiet_problems(prometheus, healthy),
        "series the rules read": _series_problems(prometheus, healthy["start"]),
        "alerts on injected faults": _fault_problems(prometheus, faults),
    }
    report = [f"{section}: {problem}" for section, found in problems.items() for problem in found]
    assert not report, "\n".join(report)
