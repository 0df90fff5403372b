"""Fail a pytest run in which a test tier collected nothing (issue #12: ``tests/dist`` was silently never collected).

A *tier* is a folder directly under the tests root (``tests/unit``, ``tests/distributed``, ``tests/ray``, ...) that
holds at least one ``*.py`` file; tiers are discovered from the filesystem, so a new tier is covered without editing
a list. When a run asks for the whole tests root (``pytest tests``, or plain ``pytest`` through ``testpaths``) or
names a tier folder itself, every such tier must contribute at least one collected item — counted before ``-m`` /
``-k`` / ``--deselect`` deselection, so skipped and deselected tests (GPU tests on a CPU machine) still count, as
do test files skipped whole at collection (``pytest.importorskip("flash_attn")`` at module level); a test file that
fails to import is pytest's own collection error, not reported again as an empty tier.

A tier can collect nothing because pytest never enters it (the default ``norecursedirs`` skips folders named
``dist``, ``build``, ``venv``, ...), because its files do not match ``python_files``, or because its test files
define no tests. The run then stops at collection with a usage error (exit code 4) naming each empty tier.

Runs narrowed to single files or test ids (``pytest tests/unit/test_x.py``) and ``--lf`` runs (which skip whole
files on purpose) are not checked, nor are tiers the run leaves out on purpose with ``--ignore`` or
``--ignore-glob`` (``pytest tests --ignore=tests/e2e``): the tier itself, or a path inside it, is ignored.

Under pytest-xdist (``-n``) the check runs in each worker, where a usage error would only crash the worker (xdist
reports an internal error without the message); there the run fails instead on one extra test item, ``::tier-guard``,
whose failure names each empty tier (:class:`EmptyTiersReport`, added after ``-m``/``-k`` deselection so none drops
it).

Usage (in the tests root's ``conftest.py``)::

    @pytest.hookimpl(tryfirst=True)  # before pytest's own -m/-k deselection
    def pytest_collection_modifyitems(config, items):
        check_tiers(config, items, Path(__file__).parent)

    def pytest_configure(config):
        config.pluginmanager.register(EmptyTiersReport(), "tier_guard_report")  # pytest-xdist workers
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path

import pytest

__all__ = ["EmptyTiersReport", "check_tiers", "discover_tiers", "empty_tiers"]

SKIPPED_BY_DEFAULT = ("build", "dist", "venv")
"""Folder names in pytest's default ``norecursedirs`` that a tier might plausibly be given."""

EMPTY_TIERS = pytest.StashKey[str]()
"""The empty-tier message a pytest-xdist worker keeps for :class:`EmptyTiersReport`."""


def discover_tiers(root: Path) -> list[Path]:
    """Folders directly under ``root`` (not hidden, not ``_``-prefixed) that contain a ``*.py`` file at any depth,
    sorted by name."""
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith((".", "_")) and next(p.rglob("*.py"), None) is not None)


def _requested_paths(config: pytest.Config) -> list[Path]:
    """The run's path arguments (``config.args``, which ``testpaths`` fills when none are given), resolved against
    the invocation directory, with ``::test-id`` suffixes removed."""
    base = Path(config.invocation_params.dir)
    return [(base / str(arg).split("::")[0]).resolve() for arg in config.args]


def _ignored_tiers(config: pytest.Config, tiers: Iterable[Path]) -> list[Path]:
    """The tiers that ``--ignore`` / ``--ignore-glob`` leave out in whole or in part: an ignored path is the tier or
    inside it, or a glob (matched as pytest does, against absolute paths) matches the tier or a ``*.py`` file in it."""
    base = Path(config.invocation_params.dir)
    paths = [(base / p).resolve() for p in config.getoption("ignore", None) or []]
    globs = [str(base / g) for g in config.getoption("ignore_glob", None) or []]
    ignored = []
    for tier in tiers:
        tier = tier.resolve()
        if (any(p.is_relative_to(tier) for p in paths)
                or any(fnmatch.fnmatch(str(f), g) for g in globs for f in [tier, *tier.rglob("*.py")])):
            ignored.append(tier)
    return ignored


def empty_tiers(root: Path, requested: Iterable[Path], collected: Iterable[Path],
                ignored: Iterable[Path] = ()) -> list[Path]:
    """The tiers under ``root`` that the run asked for but that contributed no collected item.

    Args:
        root: the tests root (e.g. ``<repo>/tests``).
        requested: resolved path arguments of the run. A tier is asked for when an argument is ``root`` or one of its
            ancestors (the whole suite), or the tier folder itself.
        collected: resolved file paths of the collected items (before deselection).
        ignored: resolved tier folders the run leaves out on purpose (``--ignore``); never reported.
    """
    root = root.resolve()
    requested = list(requested)
    ignored = set(ignored)
    per_tier: dict[str, int] = {}
    for path in collected:
        if path.is_relative_to(root) and path != root:
            tier = path.relative_to(root).parts[0]
            per_tier[tier] = per_tier.get(tier, 0) + 1
    return [tier for tier in discover_tiers(root)
            if any(root.is_relative_to(arg) or arg == tier.resolve() for arg in requested)
            and per_tier.get(tier.name, 0) == 0 and tier.resolve() not in ignored]


def _entered_without_items(config: pytest.Config) -> list[Path]:
    """Resolved paths of the test files pytest entered but took no item from: skipped whole while collecting (a
    module-level ``pytest.skip`` or ``pytest.importorskip``) or failing to import (pytest reports that error itself
    and fails the run; the tier is not empty), from the terminal reporter's collect reports (none without it,
    ``-p no:terminal``)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reports = [*reporter.stats.get("skipped", []), *reporter.stats.get("error", [])] if reporter is not None else []
    return [(config.rootpath / report.nodeid.split("::")[0]).resolve()
            for report in reports if isinstance(report, pytest.CollectReport) and report.nodeid]


def check_tiers(config: pytest.Config, items: list[pytest.Item], root: Path) -> None:
    """Raise ``pytest.UsageError`` naming every tier under ``root`` that this run asked for and collected nothing
    from (see the module docstring). Call it from a ``tryfirst`` ``pytest_collection_modifyitems`` hook.

    Raises:
        pytest.UsageError: one line per empty tier, with the likely cause (in a pytest-xdist worker the message is
            kept for :class:`EmptyTiersReport` instead).
    """
    if config.getoption("lf", False):
        return
    collected = [Path(item.path).resolve() for item in items] + _entered_without_items(config)
    empty = empty_tiers(root, _requested_paths(config), collected, _ignored_tiers(config, discover_tiers(root)))
    if not empty:
        return
    lines = []
    for tier in empty:
        cause = (f"pytest's default norecursedirs skips folders named {tier.name!r}; rename the tier (e.g. "
                 f"tests/distributed)" if tier.name in SKIPPED_BY_DEFAULT else
                 "no test was collected from its files (test_*.py files with test_* functions or Test* classes?)")
        lines.append(f"test tier {tier} collected no tests: {cause}")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        config.stash[EMPTY_TIERS] = "\n".join(lines)
        return
    raise pytest.UsageError("\n".join(lines))


class _EmptyTiersItem(pytest.Item):
    """The test item that fails a pytest-xdist run in which a tier collected nothing; its failure is the message."""

    def __init__(self, *, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        raise pytest.UsageError(self.message)

    def repr_failure(self, excinfo, style=None) -> str:
        return self.message

    def reportinfo(self):
        return self.path, None, "tier guard"


class EmptyTiersReport:
    """A pytest plugin (register it from ``pytest_configure``): in a pytest-xdist worker whose :func:`check_tiers`
    found empty tiers, append ``::tier-guard``, an item that fails naming them, after deselection. Does nothing
    without xdist (:func:`check_tiers` raised already) or when no tier is empty."""

    @pytest.hookimpl(trylast=True)  # after -m/-k deselection: the item always runs
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        message = config.stash.get(EMPTY_TIERS, None)
        if message is not None:
            items.append(_EmptyTiersItem.from_parent(session, name="tier-guard", message=message))
