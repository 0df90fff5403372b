"""Rollout engines by name: the spec's ``rollout.engine`` picks the class the rollout pool starts on every replica.

Entries are classes implementing :class:`contract.rollout_engine.RolloutEngine`, or ``"module:Class"`` strings
imported on first use, so the control plane imports no engine (nor vLLM) until a pool is built. This module is the
one owner of the engine names: the spec validates ``rollout.engine`` against :data:`ROLLOUT_ENGINES`, importing only
this module. A new engine is one folder under ``rollout_workers/`` and one line here (docs/architecture.md).

    >>> rollout_engine("hf").__name__
    'HFEngine'
"""

from __future__ import annotations

from contract.registry_entries import add_entry, resolve_entry

__all__ = ["ROLLOUT_ENGINES", "register_rollout_engine", "rollout_engine"]

#: ``rollout.engine`` → engine class, or ``"module:Class"`` resolved by :func:`rollout_engine`.
ROLLOUT_ENGINES: dict[str, type | str] = {
    "vllm": "rollout_workers.vllm.engine:VLLMEngine",
    "hf": "rollout_workers.hf.engine:HFEngine",
}


def register_rollout_engine(name: str, engine: type | str) -> None:
    """Add a rollout engine under ``name`` (a ``rollout.engine`` value). Register it in a module imported before the
    spec is validated (``grpo-cluster run --import MODULE``).

    Args:
        engine: a class implementing :class:`contract.rollout_engine.RolloutEngine`, or ``"module:Class"``.

    Raises:
        ValueError: ``name`` is registered already, or a string ``engine`` is not ``"module:Class"``.
    """
    add_entry(ROLLOUT_ENGINES, "rollout engine", name, engine)


def rollout_engine(name: str) -> type:
    """The engine class for ``rollout.engine`` = ``name``; a ``"module:Class"`` entry is imported now.

    Raises:
        ValueError: no engine is registered under ``name`` (the message names ``rollout.engine`` and the known
            names).
        ImportError, AttributeError: a string entry names a module or class that does not exist.
    """
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout.engine {name!r} has no rollout engine; known: {sorted(ROLLOUT_ENGINES)}")
    return resolve_entry(ROLLOUT_ENGINES[name])
