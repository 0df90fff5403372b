"""The tests reach the loop only through its constructor and public methods (issue 26): no test swaps a job's
collaborators or patches their methods on a built job, and none monkeypatches the driver module or ``GRPOJob``. Fault
injection lives in tests (``tests/faults.py``, ``tests/ray_faults.py``: subclasses and registered backends given to
``GRPOJob(spec, fleet=..., trainer=...)``).

The scan reads every ``*.py`` file under tests/ with :mod:`ast`; the rules are checked on hand-written snippets first,
so that a scan finding nothing means the rules work, not that they never match. Also here: every tier has a declared
cost marker, and the tests ``tests/conftest.py`` lists as starting no vLLM engine exist.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: Attributes of a job that hold its collaborators or its parts (assigning one replaces what the loop was built with).
COLLABORATORS = {"fleet", "trainer", "rollout", "train", "sync", "schedule", "producer", "training", "metrics",
                 "control", "guard", "evaluation", "scoring", "versions", "requests", "sampler", "workers",
                 "checkpoints"}

#: Methods of the loop and of its collaborators' protocols (``contract.protocols``): assigning one on an object
#: (``job.fleet.generate = ...``, ``job.run_step = ...``) patches a built job.
METHODS = {"run", "run_step", "start", "shutdown", "close", "status", "generate", "sync_policy", "train_step",
           "interrupt", "scale", "begin_step", "log_workers", "set_kl_coef", "save_checkpoint", "load_checkpoint",
           "restore", "request_stop", "set_reward_weight", "stop_workers", "scale_rollout", "produce"}

DRIVER_MODULE = "cluster.driver"


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` → ``["a", "b", "c"]``; [] when the expression is not a plain name/attribute chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    return [node.id, *reversed(parts)]


def _driver_names(tree: ast.AST) -> set[str]:
    """Local names bound to the driver module or to ``GRPOJob`` by this file's imports."""
    names = {"GRPOJob"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "cluster":
            names |= {a.asname or a.name for a in node.names if a.name == "driver"}
        elif isinstance(node, ast.ImportFrom) and node.module == DRIVER_MODULE:
            names |= {a.asname or a.name for a in node.names if a.name == "GRPOJob"}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == DRIVER_MODULE and a.asname}
    return names


def _patches_driver(call: ast.Call, driver_names: set[str]) -> bool:
    """``monkeypatch.setattr/delattr(<driver module or GRPOJob>, ...)``, the string form ``"cluster.driver..."``,
    and the builtin ``setattr(<driver>, ...)``."""
    func = call.func
    patching = (isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr", "setitem")) or (
        isinstance(func, ast.Name) and func.id in ("setattr", "delattr"))
    if not patching or not call.args:
        return False
    target = call.args[0]
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return target.value == DRIVER_MODULE or target.value.startswith(DRIVER_MODULE + ".")
    chain = _chain(target)
    return bool(chain) and (chain[0] in driver_names or ".".join(chain).startswith(DRIVER_MODULE)
                            or chain[-1] == "GRPOJob")


def _builds_a_job(node: ast.AST) -> bool:
    """The expression calls ``GRPOJob`` or a function whose name ends in ``job`` (``build_job``, ``local_job``,
    ``stand_in_job``, a test's ``_job``)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            chain = _chain(call.func)
            if chain and (chain[-1] == "GRPOJob" or chain[-1].lower().endswith("job")):
                return True
    return False


def _job_names(tree: ast.AST) -> set[str]:
    """Names that hold a job: ``job`` and names ending in ``job``, and names bound (``=``, ``with ... as``) to an
    expression that builds one (first element of a tuple target)."""
    names = {"job"}
    for node in ast.walk(tree):
        bound = []
        if isinstance(node, ast.Assign) and _builds_a_job(node.value):
            bound = node.targets
        elif isinstance(node, ast.withitem) and node.optional_vars is not None and _builds_a_job(node.context_expr):
            bound = [node.optional_vars]
        for target in bound:
            first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
            if isinstance(first, ast.Name):
                names.add(first.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id.lower().endswith("job"):
            names.add(node.id)
    return names


def _swaps_a_part(target: ast.AST, job_names: set[str]) -> bool:
    """On a job: ``job.<collaborator> = ...`` or ``job._private = ...``, or ``job(.x)*.<method> = ...`` (a method of
    the job or of one of its parts patched)."""
    chain = _chain(target)
    if len(chain) < 2 or chain[0] not in job_names:
        return False
    if len(chain) == 2 and (chain[1] in COLLABORATORS or chain[1].startswith("_") and not chain[1].startswith("__")):
        return True
    return chain[-1] in METHODS


def violations(source: str, name: str = "<snippet>") -> list[str]:
    """Each line of ``source`` that patches the driver or swaps a built job's part, as ``name:line: text``."""
    tree = ast.parse(source)
    driver_names, job_names = _driver_names(tree), _job_names(tree)
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        bad = False
        if isinstance(node, ast.Call):
            bad = _patches_driver(node, driver_names) or (
                isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) >= 2
                and _chain(node.args[0])[:1] and _chain(node.args[0])[0] in job_names
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLABORATORS | METHODS)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            bad = any(_swaps_a_part(t, job_names) for t in flat)
        if bad:
            found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


@pytest.mark.parametrize("snippet", [
    "from cluster import driver\nmonkeypatch.setattr(driver.GRPOJob, '_status', print)",
    "from cluster import driver\nmonkeypatch.setattr(driver, 'run_with_restarts', f)",
    "import cluster.driver as d\nmp.setattr(d, 'tqdm', f)",
    "monkeypatch.setattr('cluster.driver.GRPOJob.run_step', f)",
    "from cluster.driver import GRPOJob\nmonkeypatch.setattr(GRPOJob, '__init__', init)",
    "monkeypatch.setattr(cluster.driver.GRPOJob, 'run', f)",
    "setattr(job, 'fleet', other)",
    "job.fleet = other",
    "job.rollout = pool",
    "resumed = build_job(spec, resume=True)\nresumed.trainer = StandInTrainer()",
    "with stopped_after(local_job(spec)) as j:\n    j.fleet = other",
    "job, fleet = _job(spec)\njob.schedule = other",
    "job.schedule, job.producer = a, b",
    "job._status = messages.append",
    "job.rollout.generate = generate",
    "job.fleet.rollout.generate = generate",
    "job.run_step = run_step.__get__(job)",
])
def test_the_rules_find_each_kind_of_patch(snippet):
    assert violations(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "job.step = 3",
    "fleet.version = job.trainer.version = 3",
    "self.fleet = fleet",
    "monkeypatch.setattr(TrainPool, 'x', f)",
    "monkeypatch.setitem(TRAIN_BACKENDS, 'fsdp', Worker)",
    "fleet.rollout.spec = short",
    "worker._sync_group = None",
    "schedule.interrupt = failing_interrupt",
    "history = job.run()",
])
def test_the_rules_leave_the_loops_public_use_alone(snippet):
    assert violations(snippet) == [], snippet


def test_no_test_patches_the_driver_or_swaps_a_built_jobs_parts():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        found += violations(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, ("tests patch the driver or a built job's parts; give the job its collaborators instead "
                       "(GRPOJob(spec, fleet=..., trainer=...); fault injection in tests/faults.py):\n"
                       + "\n".join(found))


def test_every_tier_has_a_declared_cost_marker():
    """Each tier folder (``tests/tier_guard.discover_tiers``) gives its tests a marker that pyproject.toml declares
    (``--strict-markers``), ``unit`` and ``engine`` among them."""
    import tomllib

    from tests.conftest import TIER_MARKERS
    from tests.tier_guard import discover_tiers

    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {line.split(":")[0] for line in ini["markers"]}
    assert {"unit", "engine", "slow", "gpu"} <= declared
    tiers = {p.name for p in discover_tiers(TESTS)}
    assert tiers <= set(TIER_MARKERS), f"tiers without a marker in tests/conftest.py: {tiers - set(TIER_MARKERS)}"
    assert set(TIER_MARKERS.values()) <= declared


def test_the_tests_listed_as_starting_no_engine_exist():
    """A stale entry in ``tests/conftest.py`` NO_ENGINE (a renamed test) would silently put a test back under
    ``engine``: each entry names an existing module, and its test function."""
    from tests.conftest import NO_ENGINE

    for entry in NO_ENGINE:
        module, _, name = entry.partition("::")
        path = TESTS / module
        assert path.is_file(), entry
        if name:
            defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in defined, entry


@pytest.mark.parametrize("path, name, expected", [
    ("unit/test_spec.py", "test_x", ["unit"]),
    ("distributed/test_fsdp_parity.py", "test_x", ["distributed"]),
    ("in_process/test_loop_eval.py", "test_x", ["in_process"]),
    ("ray/test_loop_tiny.py", "test_x", ["ray", "engine"]),
    ("ray/test_rollout_pool_dispatch.py", "test_x", ["ray"]),
    ("ray/test_submit.py", "test_bad_spec_exits_2_and_submits_nothing", ["ray"]),
    ("e2e/test_eval_engine.py", "test_eval_with_the_real_engine", ["e2e", "engine"]),
    ("e2e/test_eval_engine.py", "test_answering_model_greedy_output_with_transformers", ["e2e"]),
])
def test_cost_markers_by_folder(path, name, expected):
    from tests.conftest import cost_markers

    assert cost_markers(TESTS / path, name) == expected


def test_test_modules_have_unique_names():
    """The tier folders are not packages, so pytest imports each test module by its file name: two modules of one name
    in two tiers stop a run over the whole suite at collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} and {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test modules with the same file name: " + "; ".join(clashes)


def test_no_test_module_imports_a_module_that_registers_on_import():
    """``tests/parity_reward.py`` registers ``parity`` when imported (for submitted jobs' ``--import``); a test module
    that imports it leaves ``parity`` registered for the rest of its worker's session, which changes every other
    test's "allowed: ..." list. Tests register it for one module with ``tests.registered.temporarily_registered``."""
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "tests.parity_reward" for n in names):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not offenders, "test modules importing tests.parity_reward: " + ", ".join(offenders)
