"""Import layering of the project's packages (docs/architecture.md, "Allowed imports"), read from source with ast.

Every ``import``/``from ... import`` in every .py file of the packages counts, wherever it is written: at module
level, inside a function (lazy imports), under ``if TYPE_CHECKING:``; relative imports are resolved against the
file's package, and ``importlib.import_module("literal.name")`` counts as an import of that name. The rules:

1. ``grpo/`` (the pure algorithm core) imports no other project package, nor Ray, nor ``torch.distributed``, nor a
   network client (``httpx``, ``aiohttp``, ``requests``, ``urllib.request``, ``http.client``, ``socket``): a reward
   served over the network lives in ``cluster/rewards/``.
2. ``contract/`` (the ground floor every role shares: messages, batches, figures, the version ledger, the role
   protocols) imports no other project package, nor Ray, pydantic or vLLM.
3. ``rollout_workers/`` and ``train_workers/`` do not import each other, and import nothing from ``cluster/``: what
   they share with the control plane is ``contract/``.
4. ``weight_sync/`` (transport only) imports neither ``cluster/`` nor the workers.
5. The loop (``cluster/driver.py`` and ``cluster/loop/**``) imports neither Ray nor the runtimes (the Ray shell
   ``cluster.ray_shell``, the in-process runtime ``cluster.in_process``), nor vLLM, nor a concrete train backend
   module (``train_workers.fsdp_*``, ``train_workers.megatron*``): it speaks the ``contract`` protocols to the
   collaborators it is given.
6. ``cluster/loop/overlap.py`` (the ``rollout.mode`` schedules) and the package files imported with it
   (``cluster/__init__.py``, ``cluster/loop/__init__.py``) import no project package, nor Ray, pydantic or vLLM: the
   device check's ``async_overlap`` section (``bench/gpu_check_async.py``) runs the schedules with torch alone.
7. The command line is the top: nothing in ``cluster/`` but ``cluster/cli.py`` and ``cluster/ops/`` imports
   ``cluster.ops`` or ``cluster.cli`` (the loop, the runtimes, the metric sinks, the spec, the data and the reward
   pools are imported by the command line, never the other way).
8. The metric sinks (``cluster/sinks/``: ``metrics.jsonl``, Prometheus, trackers, the run picture), which the loop
   calls every step, import neither the loop (``cluster.driver``, ``cluster.loop``) nor the runtimes.
9. ``sandbox/`` (the sandbox, its process supervision and the ``code`` rewards) imports no project package but
   ``grpo/`` (and ``contract/``), nor Ray, nor torch; ``grpo/`` names what it needs from it by import path (rule 1
   keeps ``grpo/`` from importing it), and every such name resolves to a ``sandbox`` object
   (:func:`test_grpo_names_sandbox_objects_that_exist`).
10. No file outside ``rollout_workers/vllm/`` imports vLLM: every vLLM-specific piece is the ``vllm`` rollout engine's
    (a new engine costs one folder and one registry line, ``rollout_workers.registry``).

A failure names ``file:line``, the offending import statement and the rule it breaks. The self-tests at the end feed
the checker synthetic sources, one per rule, so each rule is shown to fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Packages whose files are checked (the installable ones, pyproject's ``packages.find``).
CHECKED_PACKAGES = ("contract", "grpo", "cluster", "rollout_workers", "train_workers", "weight_sync", "sandbox")
#: Every top-level package/folder of this repository that a module could import.
PROJECT_PACKAGES = (*CHECKED_PACKAGES, "deploy", "bench", "tests", "scripts", "examples")
#: Train-backend implementation modules the loop must not name (it uses train_workers' registry and protocol); a
#: trailing ``*`` matches any module whose dotted name starts so (``train_workers.fsdp_worker``, ``..._step``, ...).
CONCRETE_TRAIN_BACKENDS = ("train_workers.fsdp*", "train_workers.megatron*")
#: HTTP and socket clients, which the pure core does not hold.
NETWORK_CLIENTS = ("httpx", "aiohttp", "requests", "urllib.request", "urllib3", "http.client", "socket")


@dataclass(frozen=True)
class Import:
    """One import found in a file: ``name`` is the absolute module (``cluster.ray_shell.pools``; for
    ``from a import b, c`` it is ``a`` and ``members`` is ``("b", "c")``, each possibly a submodule); ``statement`` is
    the source text of the statement; ``line`` is 1-based."""

    name: str
    line: int
    statement: str
    members: tuple[str, ...] = ()


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """``a.b`` matches ``a.b`` and ``a.b.c``; ``a.b*`` matches any name starting with ``a.b``."""
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p or name.startswith(p + ".") for p in patterns)


@dataclass(frozen=True)
class Rule:
    """``name``: the rule's test id. Files whose repository-relative path equals or starts with one of ``files`` (and
    with none of ``exempt``) must import no module that matches ``forbidden`` unless it also matches ``allowed`` (see
    :func:`_matches`); ``why`` is printed with each violation."""

    name: str
    files: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()

    def applies_to(self, rel_path: str) -> bool:
        def under(prefixes: tuple[str, ...]) -> bool:
            return any(rel_path == f or rel_path.startswith(f) for f in prefixes)

        return under(self.files) and not under(self.exempt)

    def offending(self, imp: Import) -> str | None:
        """The first module ``imp`` brings in that breaks the rule, or None. ``from a import b`` brings in ``a`` and
        ``a.b``; when every ``a.b`` is allowed, ``a`` is only the path to them (``from cluster import messages``)."""
        def bad(name: str) -> bool:
            return _matches(name, self.forbidden) and not _matches(name, self.allowed)

        members = [f"{imp.name}.{m}" for m in imp.members]
        if members and self.allowed and all(_matches(m, self.allowed) for m in members):
            return None
        return next((name for name in (imp.name, *members) if bad(name)), None)


_WORKERS_APART = "rollout_workers/ and train_workers/ do not import each other"
RULES = (
    Rule("grpo_is_pure", ("grpo/",), (*(p for p in PROJECT_PACKAGES if p != "grpo"), "ray", "torch.distributed"),
         "grpo/ is the pure algorithm core: it imports no other project package, nor Ray, nor torch.distributed"),
    Rule("grpo_has_no_network_client", ("grpo/",), NETWORK_CLIENTS,
         "grpo/ is the pure algorithm core: a reward answered over the network is a client of cluster/rewards/ "
         "(cluster.rewards.endpoint), not a pure function"),
    Rule("contract_is_ground_floor", ("contract/",),
         (*(p for p in PROJECT_PACKAGES if p != "contract"), "ray", "pydantic", "vllm"),
         "contract/ is the ground floor every role imports: it imports no other project package, nor Ray, "
         "pydantic or vLLM"),
    Rule("rollout_workers_not_train", ("rollout_workers/",), ("train_workers",), _WORKERS_APART),
    Rule("train_workers_not_rollout", ("train_workers/",), ("rollout_workers",), _WORKERS_APART),
    Rule("workers_not_cluster", ("rollout_workers/", "train_workers/"), ("cluster",),
         "the workers import nothing from cluster/: what they share with the control plane is contract/"),
    Rule("weight_sync_not_cluster", ("weight_sync/",), ("cluster",),
         "weight_sync/ is transport only: it does not import cluster/"),
    Rule("weight_sync_not_workers", ("weight_sync/",), ("rollout_workers", "train_workers"),
         "weight_sync/ is transport only: the workers use it, it does not import them"),
    Rule("overlap_is_pure", ("cluster/loop/overlap.py", "cluster/loop/__init__.py", "cluster/__init__.py"),
         (*PROJECT_PACKAGES, "contract", "ray", "pydantic", "vllm"),
         "cluster.loop.overlap orders three callables and nothing else: the device check imports it where only torch "
         "and transformers are installed (bench/gpu_check_async.py)"),
    Rule("sandbox_below_the_control_plane", ("sandbox/",),
         (*(p for p in PROJECT_PACKAGES if p not in ("sandbox", "grpo", "contract")), "ray", "torch"),
         "sandbox/ runs programs and judges them: it imports no project package but grpo/ and contract/, nor Ray, "
         "nor torch"),
    Rule("loop_is_pure", ("cluster/driver.py", "cluster/loop/"),
         ("ray", "vllm", "cluster.ray_shell", "cluster.in_process", "rollout_workers", *CONCRETE_TRAIN_BACKENDS),
         "the loop (cluster/driver.py, cluster/loop/) is given its collaborators: it imports neither Ray, vLLM, the "
         "runtimes (cluster.ray_shell, cluster.in_process), the engines nor a concrete train backend"),
    Rule("command_line_is_the_top", ("cluster/",), ("cluster.ops", "cluster.cli"),
         "the command line (cluster/cli.py, cluster/ops/) imports the loop, the runtimes and the sinks, never the "
         "other way: nothing else in cluster/ imports cluster.ops or cluster.cli",
         exempt=("cluster/ops/", "cluster/cli.py")),
    Rule("sinks_below_the_loop", ("cluster/sinks/",),
         ("cluster.driver", "cluster.loop", "cluster.ray_shell", "cluster.in_process"),
         "the metric sinks (cluster/sinks/) are called by the loop every step: they import neither the loop "
         "(cluster.driver, cluster.loop) nor the runtimes (cluster.ray_shell, cluster.in_process)"),
    Rule("vllm_only_in_its_engine_folder", tuple(f"{p}/" for p in CHECKED_PACKAGES), ("vllm",),
         "vLLM is one rollout engine among others: only its folder rollout_workers/vllm/ imports vllm (other code "
         "picks an engine from rollout_workers.registry)", exempt=("rollout_workers/vllm/",)),
)


def imports_in(rel_path: str, source: str) -> list[Import]:
    """Every import in a file, lazy ones included, with absolute module names, in line order.

    Relative imports are resolved against ``rel_path``'s package. Raises SyntaxError when ``source`` does not parse.
    """
    tree = ast.parse(source, filename=rel_path)
    found: list[Import] = []
    for node in ast.walk(tree):
        is_import_call = isinstance(node, ast.Call) and _is_import_module(node.func) and node.args
        if isinstance(node, (ast.Import, ast.ImportFrom)) or is_import_call:
            text = " ".join((ast.get_source_segment(source, node) or "").split())
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno, text) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is the file's own package, each further dot one package up
                package = Path(rel_path).parts[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append(Import(base, node.lineno, text, tuple(a.name for a in node.names if a.name != "*")))
        elif is_import_call:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(arg.value, node.lineno, text))
    return sorted(found, key=lambda imp: imp.line)


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def rule_violations(rule: Rule, rel_path: str, source: str) -> list[str]:
    """``file:line: `statement` imports module: why`` for each import in ``source`` that breaks ``rule``; [] when the
    rule does not apply to the file."""
    if not rule.applies_to(rel_path):
        return []
    return [f"{rel_path}:{imp.line}: `{imp.statement}` imports {bad}: {rule.why}"
            for imp in imports_in(rel_path, source) if (bad := rule.offending(imp)) is not None]


def violations(rel_path: str, source: str) -> list[str]:
    """:func:`rule_violations` of every rule."""
    return [v for rule in RULES for v in rule_violations(rule, rel_path, source)]


def project_files() -> list[Path]:
    """Every .py file of the checked packages."""
    return sorted(path for package in CHECKED_PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_checked_packages_exist_and_parse():
    files = project_files()
    for package in CHECKED_PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), f"expected package {package}/ at {ROOT}"
    assert len(files) > 20, f"expected the project's modules, found only {len(files)} .py files"
    for path in files:  # a file that does not parse would hide its imports from the rules
        imports_in(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_import_layering(rule: Rule):
    problems = []
    for path in project_files():
        rel = path.relative_to(ROOT).as_posix()
        problems += rule_violations(rule, rel, path.read_text(encoding="utf-8"))
    assert not problems, "imports that break the layering:\n" + "\n".join(problems)


# --------------------------------------------------------------------------------------------- checker self-tests

@pytest.mark.parametrize(("rel_path", "source", "offending"), [
    ("grpo/losses.py", "import torch\ndef f():\n    from cluster.spec import JobSpec\n", "cluster.spec"),
    ("grpo/losses.py", "import ray\n", "ray"),
    ("grpo/losses.py", "import torch.distributed as dist\n", "torch.distributed"),
    ("grpo/losses.py", "from torch import distributed\n", "torch.distributed"),
    ("grpo/losses.py", "from contract.messages import GroupResult\n", "contract.messages"),
    ("grpo/x.py", "import importlib\nm = importlib.import_module('bench._common')\n", "bench._common"),
    ("grpo/rewards/endpoint.py", "import httpx\n", "httpx"),
    ("grpo/rewards/x.py", "def f():\n    import urllib.request\n", "urllib.request"),
    ("grpo/rewards/x.py", "from urllib import request\n", "urllib.request"),
    ("contract/messages.py", "from cluster.spec import JobSpec\n", "cluster.spec"),
    ("contract/batches.py", "def f():\n    from weight_sync.buckets import Bucket\n", "weight_sync.buckets"),
    ("contract/protocols.py", "from grpo.kl import kl\n", "grpo.kl"),
    ("contract/protocols.py", "import ray\n", "ray"),
    ("contract/figures.py", "from pydantic import BaseModel\n", "pydantic"),
    ("rollout_workers/vllm/engine.py", "from train_workers.packing import pack\n", "train_workers.packing"),
    ("train_workers/fsdp_worker.py", "def f():\n    import rollout_workers.vllm.engine\n",
     "rollout_workers.vllm.engine"),
    ("rollout_workers/hf/engine.py", "from cluster.ray_shell.pools import RolloutPool\n", "cluster.ray_shell.pools"),
    ("train_workers/fsdp_step.py", "from cluster import messages, spec\n", "cluster"),
    ("train_workers/fsdp_step.py", "import cluster.spec\n", "cluster.spec"),
    ("train_workers/fsdp_step.py", "from cluster.loop.sampling import RolloutBatch\n", "cluster.loop.sampling"),
    ("weight_sync/sender.py", "def f():\n    from cluster.ray_shell.pools import get\n", "cluster.ray_shell.pools"),
    ("weight_sync/sender.py", "from cluster import messages\n", "cluster"),
    ("cluster/driver.py", "from train_workers.fsdp_worker import FSDPTrainWorker\n", "train_workers.fsdp_worker"),
    ("cluster/driver.py", "import ray\n", "ray"),
    ("cluster/driver.py", "from cluster.ray_shell.pools import TrainPool\n", "cluster.ray_shell.pools"),
    ("cluster/driver.py", "def f():\n    from cluster.ray_shell import control\n", "cluster.ray_shell"),
    ("cluster/loop/guard.py", "from ray.util import placement_group\n", "ray.util"),
    ("cluster/loop/scoring.py", "from cluster.in_process.fleet import LocalFleet\n", "cluster.in_process.fleet"),
    ("cluster/loop/training.py", "from rollout_workers.vllm.engine import VLLMEngine\n",
     "rollout_workers.vllm.engine"),
    ("cluster/loop/training.py", "from train_workers import fsdp_step\n", "train_workers.fsdp_step"),
    ("cluster/loop/training.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from train_workers.fsdp_sync import x\n", "train_workers.fsdp_sync"),
    ("weight_sync/group.py", "from train_workers.sharding import full_tensor\n", "train_workers.sharding"),
    ("weight_sync/group.py", "def f():\n    import rollout_workers.hf.engine\n", "rollout_workers.hf.engine"),
    ("cluster/__init__.py", "from cluster.spec import JobSpec\n", "cluster.spec"),
    ("cluster/loop/overlap.py", "from cluster.spec import RolloutSpec\n", "cluster.spec"),
    ("cluster/loop/overlap.py", "from contract.errors import RecoveryDeferred\n", "contract.errors"),
    ("cluster/loop/overlap.py", "def f():\n    import ray\n", "ray"),
    ("cluster/loop/__init__.py", "from pydantic import BaseModel\n", "pydantic"),
    ("cluster/driver.py", "from cluster.ops.metrics import MetricsLogger\n", "cluster.ops.metrics"),
    ("cluster/ray_shell/ray_init.py", "def f():\n    from cluster.ops.jobs import connect\n", "cluster.ops.jobs"),
    ("cluster/in_process/trainer.py", "from cluster.ops import model_checks\n", "cluster.ops"),
    ("cluster/loop/evaluation.py", "import cluster.cli\n", "cluster.cli"),
    ("cluster/sinks/trackers/__init__.py", "from cluster.ops.plot import plot_run\n", "cluster.ops.plot"),
    ("cluster/sinks/metrics.py", "from cluster.loop.setup import SetupError\n", "cluster.loop.setup"),
    ("cluster/sinks/plot.py", "from cluster.driver import GRPOJob\n", "cluster.driver"),
    ("cluster/sinks/trackers/x.py", "def f():\n    from cluster.ray_shell import pools\n", "cluster.ray_shell"),
    ("grpo/rewards/__init__.py", "def f():\n    from sandbox.code_reward import code_reward\n", "sandbox.code_reward"),
    ("sandbox/judge.py", "from cluster.data import DataError\n", "cluster.data"),
    ("sandbox/runner.py", "import torch\n", "torch"),
    ("cluster/data/model_checks.py", "def f():\n    from vllm.model_executor.models import ModelRegistry\n",
     "vllm.model_executor.models"),
    ("rollout_workers/hf/engine.py", "import vllm\n", "vllm"),
    ("rollout_workers/partial.py", "from vllm import SamplingParams\n", "vllm"),
    ("contract/console.py", "import importlib\nimportlib.import_module('vllm.logger')\n", "vllm.logger"),
])
def test_checker_finds_each_kind_of_violation(rel_path, source, offending):
    found = violations(rel_path, source)
    assert found, f"expected a violation for {offending} in {rel_path}"
    assert all(v.startswith(f"{rel_path}:") for v in found), found
    assert any(f" imports {offending}:" in v for v in found), found


@pytest.mark.parametrize(("rel_path", "source"), [
    ("grpo/losses.py", "import torch\nfrom grpo.kl import kl\nfrom . import rewards\n"),
    ("contract/protocols.py", "from contract.messages import GroupResult\nimport torch\n"),
    ("rollout_workers/vllm/engine.py",
     "from contract.messages import GroupResult\nfrom weight_sync.buckets import b\n"),
    ("train_workers/fsdp_step.py", "from contract import messages\nimport contract.batches as m\n"),
    ("weight_sync/sender.py", "from weight_sync.buckets import Bucket\nimport torch.distributed\n"),
    ("cluster/driver.py", "from contract.protocols import Fleet, Trainer\nfrom cluster.loop.guard import Guard\n"),
    ("cluster/loop/training.py", "from train_workers.packing import pack_rank_microbatches\n"),
    ("cluster/ray_shell/pools.py", "import ray\nfrom train_workers.registry import train_backend\n"),
    ("cluster/ops/cli_jobs.py", "from train_workers.fsdp_worker import FSDPTrainWorker\n"),
    ("cluster/ops/cli_validate.py", "from cluster.ops.prepare import prepare_job\nfrom cluster.sinks import plot\n"),
    ("cluster/cli.py", "from cluster.ops.cli_args import Parser\n"),
    ("cluster/driver.py", "from cluster.sinks.metrics import MetricsLogger\n"),
    ("cluster/sinks/trackers/__init__.py", "from cluster.sinks.metrics import MetricsError\n"),
    ("train_workers/registry.py", "from train_workers.fsdp_worker import FSDPTrainWorker\n"),
    ("sandbox/python_tool.py", "from grpo.environments.base import EnvironmentInfraError\n"),
    ("cluster/data/humaneval.py", "from sandbox.asserts import calls_from_check\n"),
    ("rollout_workers/vllm/engine.py", "from vllm import LLM\nfrom rollout_workers.partial import assemble_group\n"),
    ("rollout_workers/vllm/extension.py", "import vllm.v1.engine\n"),
    ("cluster/ray_shell/rollout_pool.py", "from rollout_workers.registry import rollout_engine\n"),
])
def test_checker_accepts_allowed_imports(rel_path, source):
    assert violations(rel_path, source) == []


def test_relative_imports_resolve_against_the_files_package():
    found = imports_in("cluster/loop/pools.py", "from . import fleet\nfrom ..spec import x\n")
    assert [(imp.name, imp.members) for imp in found] == [("cluster.loop", ("fleet",)), ("cluster.spec", ("x",))]
    # three dots from weight_sync/sub/ reach the top level
    assert violations("weight_sync/sub/x.py", "from ...cluster import pools\n")


def test_violation_names_file_line_and_statement():
    source = "import os\n\n\ndef late():\n    from cluster.ray_shell.pools import get  # lazy\n"
    assert violations("weight_sync/coordinator.py", source) == [
        "weight_sync/coordinator.py:5: `from cluster.ray_shell.pools import get` imports cluster.ray_shell.pools: "
        "weight_sync/ is transport only: it does not import cluster/"]


def test_grpo_names_sandbox_objects_that_exist():
    """Rule 7: what grpo/ names by import path (lazy registry entries, the ``python`` tool) lives in ``sandbox/`` and
    resolves; grpo/ itself stays free of it (rule 1)."""
    from grpo.environments.tool_env import PYTHON_TOOL
    from grpo.registry import load_target
    from grpo.rewards import REWARD_FUNCTIONS

    targets = [PYTHON_TOOL, *REWARD_FUNCTIONS.targets.values()]
    assert "sandbox.code_reward:code_reward" in targets and len(targets) >= 3, targets
    for target in targets:
        assert target.split(".")[0] == "sandbox", target
        assert callable(load_target(target)), target
