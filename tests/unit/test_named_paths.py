"""Every module path and file path the project names in prose exists.

A message that tells a user to call a function under a module path where it is not, or a docstring that sends a
reader to a file that moved, is a broken promise no other test sees. This test reads every source file of the project
(the packages, ``bench/``, ``tests/``, ``scripts/``, ``examples/``, ``deploy/``, ``.ci/``) and every page
(``README.md``, ``docs/*.md``) — in Python files the strings (docstrings, messages) and the comments, elsewhere the
whole text — and checks two kinds of names:

- a dotted name rooted at a project package (a top-level folder with an ``__init__.py``: ``contract``, ``grpo``,
  ``cluster``, ``rollout_workers``, ``train_workers``, ``weight_sync``, ``bench``, ``tests``, ...), such as
  ``cluster.loop.guard.GuardTarget`` or ``grpo.rewards.REWARD_FUNCTIONS``: its longest module prefix must be a
  module or package of the repository, and the rest must be defined there — a top-level function, class, assignment
  or import of that module, then a member of that class (a method, a class attribute, an annotated field, or an
  attribute its methods set on ``self``); names reached through an import are followed to the module that defines
  them;
- a repository path rooted at a top-level folder (``cluster/loop/training.py``, ``docs/trackers.md``,
  ``tests/unit/``): it must exist (a ``::test`` suffix is dropped; paths with ``*``, ``<`` or ``{`` are patterns, not
  paths); a module's path without ``.py`` (``bench/step_budget``), or with an attribute
  (``tests/reward_faults.RewardServer``), counts when the module exists and defines the attribute.

Names that stand for files that need not exist — the synthetic sources of a checker's self-tests, an example of a
user's own module — are listed in :data:`EXAMPLES` with their file. This file itself is not read: its self-tests and
:data:`EXAMPLES` name stale paths on purpose.

Resolution is static (``ast``), so nothing is imported: optional libraries (vLLM, Megatron, the trackers) need not be
installed, and the check takes about a second. A name two attributes below a class (``TrackerSink.backend.name``) is
accepted once the first attribute is found: what an attribute holds is not known without running the code.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Importable top-level packages of the repository (folders with an ``__init__.py``: contract, grpo, cluster, ...,
#: bench, tests): a dotted name starting with one of these is a module path.
PACKAGES = tuple(sorted(path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file()))
#: Top-level folders a file path may start with.
FOLDERS = (*PACKAGES, "docs", "examples", "deploy", "scripts")
#: Where names are read: (folder or file, glob).
SOURCES = (*((package, "**/*.py") for package in PACKAGES), ("scripts", "**/*"), ("examples", "**/*"),
           ("deploy", "**/*"), ("docs", "*.md"), ("README.md", ""), ("Makefile", ""), ("pyproject.toml", ""),
           (".ci", "**/*"))
#: Suffixes that make ``cluster.yaml`` a file name, not a module path.
FILE_SUFFIXES = ("py", "md", "yaml", "yml", "json", "jsonl", "toml", "txt", "log", "sh", "png", "html", "csv", "db",
                 "cfg", "ini", "gz", "partial")

DOTTED = re.compile(rf"(?<![\w./\-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)(?![\w*])")
PATH = re.compile(rf"(?<![\w./\-~$])((?:{'|'.join(FOLDERS)})/[\w./\-]*)")

#: file → names it may give that do not exist, and why.
EXAMPLES: dict[str, tuple[str, set[str]]] = {
    "tests/unit/test_import_layering.py": ("the checker's self-tests feed it synthetic files and imports", {
        "grpo/x.py", "train_workers/fsdp_step.py", "cluster/sinks/trackers/x.py", "cluster/loop/pools.py",
        "weight_sync/sub/", "weight_sync/sub/x.py", "weight_sync/coordinator.py", "train_workers.fsdp_step",
        "cluster.ops.metrics", "cluster.ops.plot", "grpo/rewards/endpoint.py", "grpo/rewards/x.py"}),
    "docs/trackers.md": ("the example of a tracker to add", {"cluster/sinks/trackers/neptune_tracker.py",
                                                             "cluster.sinks.trackers.neptune_tracker"}),
    "tests/tier_guard.py": ("examples of tier folders and test files", {"tests/dist", "tests/unit/test_x.py"}),
    "tests/unit/test_jobs_control.py": ("files the upload filter is tried on", {
        "tests/deep/__pycache__/t.pyc", "cluster/__pycache__/cli.cpython-311.pyc"}),
}


@dataclass(frozen=True)
class Named:
    """A name found in a file: the name, the file (repository-relative) and the 1-based line."""

    name: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.name}"


def source_files() -> list[Path]:
    """Every file :data:`SOURCES` names (text files only)."""
    files = set()
    for where, pattern in SOURCES:
        base = ROOT / where
        candidates = [base] if not pattern else base.glob(pattern) if base.is_dir() else []
        files.update(path for path in candidates if path.is_file() and "__pycache__" not in path.parts)
    return sorted(files - {Path(__file__).resolve()})


def prose(text: str, rel: str) -> list[tuple[int, str]]:
    """(first line, text) of what names are read from: a Python file's string and comment tokens (its code is
    checked by Python itself), another file's whole text."""
    if not rel.endswith(".py"):
        return [(1, text)]
    kinds = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
            if token.type in kinds]


def names_in(text: str, rel: str) -> tuple[list[Named], list[Named]]:
    """(dotted names, file paths) that ``text`` (the file ``rel``) names in its prose (:func:`prose`), in order."""
    dotted, paths = [], []
    lines = [(first + offset, line) for first, chunk in prose(text, rel)
             for offset, line in enumerate(chunk.splitlines())]
    for number, line in lines:
        for match in DOTTED.finditer(line):
            name = match.group(1)
            if name.rsplit(".", 1)[1] not in FILE_SUFFIXES:
                dotted.append(Named(name, rel, number))
        for match in PATH.finditer(line):
            path = match.group(1).split("::")[0].rstrip(".")
            if not re.search(r"[*<{]", line[match.end():match.end() + 1] + path) and not path.endswith("/."):
                paths.append(Named(path, rel, number))
    return dotted, paths


# --------------------------------------------------------------------------------------------- static resolution

@functools.cache
def _module_file(module: str) -> Path | None:
    """The file of a repository module (``a/b.py`` or ``a/b/__init__.py``), None when there is none."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _targets(node: ast.AST) -> list[str]:
    """Names an assignment target binds (tuples unpacked)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for elt in node.elts for name in _targets(elt)]
    return []


def _bindings(body: list[ast.stmt], module: str) -> dict[str, tuple[str, object]]:
    """What the statements of a module or class body bind: name → ("def", node), ("import", "pkg.mod[.attr]") or
    ("value", None). Statements under ``if``/``try`` count (``if TYPE_CHECKING:``, optional imports)."""
    found: dict[str, tuple[str, object]] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = ("def", node)
        elif isinstance(node, ast.Assign):
            found.update({name: ("value", None) for t in node.targets for name in _targets(t)})
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            found.update({name: ("value", None) for name in _targets(node.target)})
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = ("import", alias.name if alias.asname else
                                                                   alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - node.level + (1 if _is_package(module) else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found[alias.asname or alias.name] = ("import", f"{base}.{alias.name}")
        elif isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ())),
                      getattr(node, "finalbody", [])]
            for block in blocks:
                found.update(_bindings(block, module))
    if "__getattr__" in found:  # a lazy module (PEP 562): the names its __all__ lists resolve on first use
        for node in body:
            names_all = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                             for t in node.targets)
            if names_all and isinstance(node.value, (ast.List, ast.Tuple)):
                found.update({e.value: ("value", None) for e in node.value.elts
                              if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value not in found})
    return found


def _is_package(module: str) -> bool:
    path = _module_file(module)
    return path is not None and path.name == "__init__.py"


def _class_members(node: ast.ClassDef, module: str) -> set[str]:
    """A class's members: its body's bindings and every ``self.X`` its methods assign."""
    members = set(_bindings(node.body, module))
    for item in ast.walk(node):
        if isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.add(t.attr)
    return members


def resolve(name: str, depth: int = 0) -> str | None:
    """None when ``name`` resolves (module docstring), else why not."""
    parts = name.split(".")
    cut = next((i for i in range(len(parts), 0, -1) if _module_file(".".join(parts[:i]))), 0)
    if cut == 0:
        return f"no module {parts[0]}"
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return None
    bindings = _bindings(_tree(_module_file(module)).body, module)
    first = rest[0]
    if first not in bindings:
        if first.startswith("__") and first.endswith("__"):
            return None  # a module's own attribute (__file__, __path__, __version__)
        return f"{module} defines no {first!r}"
    kind, what = bindings[first]
    if kind == "import":
        target = str(what)
        if target.split(".")[0] not in PACKAGES or depth > 5:
            return None  # a library's name: not ours to check
        return resolve(".".join([target, *rest[1:]]), depth + 1)
    if len(rest) == 1 or kind != "def" or not isinstance(what, ast.ClassDef):
        return None
    enum = any(isinstance(b, ast.Name) and b.id in ("Enum", "IntEnum", "StrEnum") for b in what.bases)
    if enum or rest[1] in _class_members(what, module):
        return None
    for base in what.bases:  # inherited members: a base class of the project, by its name in this module
        if isinstance(base, ast.Name) and base.id in bindings:
            base_kind, base_what = bindings[base.id]
            base_path = str(base_what) if base_kind == "import" else f"{module}.{base.id}"
            if resolve(f"{base_path}.{rest[1]}", depth + 1) is None:
                return None
    return f"{module}.{first} has no member {rest[1]!r}"


# ------------------------------------------------------------------------------------------------------------ tests

@functools.cache
def _all_names() -> tuple[list[Named], list[Named]]:
    dotted, paths = [], []
    for path in source_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (a picture)
        found = names_in(text, path.relative_to(ROOT).as_posix())
        dotted += found[0]
        paths += found[1]
    return dotted, paths


def _example(named: Named) -> bool:
    return named.name in EXAMPLES.get(named.file, ("", set()))[1]


def path_exists(path: str) -> bool:
    """``path`` exists, or names a module without ``.py`` or with an attribute (module docstring)."""
    if (ROOT / path).exists() or (ROOT / f"{path}.py").is_file():
        return True
    module, dot, attribute = path.partition(".")
    return bool(dot) and (ROOT / f"{module}.py").is_file() and resolve(
        f"{module.replace('/', '.')}.{attribute}") is None


def test_every_dotted_name_resolves():
    assert {"contract", "grpo", "cluster", "rollout_workers", "train_workers", "weight_sync", "tests"} <= set(PACKAGES)
    dotted, _ = _all_names()
    assert len(dotted) > 500, f"expected the project's many dotted names, found {len(dotted)}"
    broken = [f"{named}: {why}" for named in dotted if (why := resolve(named.name)) is not None and not _example(named)]
    assert not broken, "module paths named in the source or the docs that do not exist:\n" + "\n".join(broken)


def test_every_repository_path_exists():
    _, paths = _all_names()
    assert len(paths) > 200, f"expected the project's many file paths, found {len(paths)}"
    broken = [str(named) for named in paths if not path_exists(named.name) and not _example(named)]
    assert not broken, "repository paths named in the source or the docs that do not exist:\n" + "\n".join(broken)


# --------------------------------------------------------------------------------------------- checker self-tests

@pytest.mark.parametrize("name", [
    "cluster.ray_shell.build_job",  # the function is in cluster.ray_shell.runtime
    "cluster.ops.metrics.MetricsLogger",  # moved to cluster.sinks.metrics
    "cluster.driver.GRPOJob.no_such_method",
    "grpo.rewards.NO_SUCH_REGISTRY",
    "contract.no_such_module",
])
def test_a_stale_name_is_found(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("name", [
    "cluster.ray_shell.runtime.build_job",
    "cluster.driver.GRPOJob.run_step",
    "cluster.driver.GRPOJob.scoring",  # set on self in __init__
    "cluster.sinks.trackers.TrackerSink",  # defined in the package's __init__
    "cluster.sinks.trackers.EVAL_COLUMNS",  # imported there from .common: followed
    "cluster.loop",
    "grpo.rewards.REWARD_FUNCTIONS",
    "contract.protocols.Fleet.generate",
    "cluster.sinks.trackers.TrackerSink.backend.name",  # below an attribute: accepted
])
def test_a_live_name_resolves(name):
    assert resolve(name) is None, resolve(name)


def test_names_are_read_from_prose_messages_and_paths():
    text = ('raise SetupError("build a ready job with cluster.ray_shell.build_job(spec)")\n'
            "# see ``cluster/ops/metrics.py`` and docs/trackers.md, tests/unit/test_x.py::test_y\n"
            "x = cluster.stop()  # code is Python's to check; train_workers.fsdp_* is a pattern\n"
            '"""grpo-cluster.yaml, the cluster.yaml file, runs/<name>/x.py, examples/*.yaml, ../cluster/x.py\n'
            'and on a later line grpo.kl.KL_ESTIMATORS"""\n')
    dotted, paths = names_in(text, "x.py")
    assert [(n.name, n.line) for n in dotted] == [("cluster.ray_shell.build_job", 1), ("grpo.kl.KL_ESTIMATORS", 5)]
    assert [(n.name, n.line) for n in paths] == [("cluster/ops/metrics.py", 2), ("docs/trackers.md", 2),
                                                 ("tests/unit/test_x.py", 2)]
    assert [n.name for n in names_in("cluster.stop() and cluster/x", "notes.md")[0]] == ["cluster.stop"]


def test_module_paths_without_suffix_or_with_an_attribute_count_as_files():
    assert path_exists("bench/step_budget") and path_exists("tests/reward_faults.RewardServer")
    assert not path_exists("tests/reward_faults.NoSuchServer") and not path_exists("bench/no_such_bench")
