"""Entries of the registries keyed by a spec's names — ``train_workers.registry`` (``train.strategy``),
``rollout_workers.registry`` (``rollout.engine``), ``cluster.sinks.trackers.registry`` (``metrics.trackers``): a class,
or a ``"module:Class"`` string imported on first use, so whoever validates the spec imports no implementation.

Part of the ground-floor ``contract`` package, which imports no other project package.
"""

from __future__ import annotations

import importlib


def split_entry(path: str) -> tuple[str, str] | None:
    """``"pkg.mod:Class"`` → ``("pkg.mod", "Class")``; None when either part is missing."""
    module, _, cls = path.partition(":")
    return (module, cls) if module and cls else None


def add_entry(registry: dict[str, type | str], kind: str, name: str, entry: type | str) -> None:
    """Add ``entry`` (a class, or ``"module:Class"``) under ``name`` to ``registry``; ``kind`` names what the registry
    holds in the errors (``"train backend"``).

    Raises:
        ValueError: ``name`` is registered already, or a string ``entry`` is not ``"module:Class"``.
    """
    if name in registry:
        raise ValueError(f"{kind} {name!r} is registered already ({registry[name]!r})")
    if isinstance(entry, str) and not split_entry(entry):
        raise ValueError(f"{kind} {name!r}: expected 'module:Class', got {entry!r}")
    registry[name] = entry


def resolve_entry(entry: type | str) -> type:
    """The class of a registry entry: ``entry`` itself, or the class a ``"module:Class"`` string names, its module
    imported now.

    Raises:
        ImportError, AttributeError: the string names a module or class that does not exist.
    """
    if not isinstance(entry, str):
        return entry
    module, cls = split_entry(entry)
    return getattr(importlib.import_module(module), cls)
