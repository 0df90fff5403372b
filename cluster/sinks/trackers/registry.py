"""Experiment trackers by name: the spec's ``metrics.trackers`` picks the classes a job's tracker sinks wrap.

Entries are classes implementing :class:`contract.trackers.Tracker`, or ``"module:Class"`` strings imported on first
use. This module is the one owner of the tracker names: the spec validates ``metrics.trackers`` against
:data:`TRACKERS` (``cluster.spec.variants.TRACKER``), importing only this module. Adding a tracker is one module
(the class) and one line here, or a :func:`register_tracker` call in a module imported before the spec is validated
(``grpo-cluster run --import MODULE``); docs/trackers.md, "Adding a tracker".

    >>> tracker_class("tensorboard").__name__
    'TensorBoardTracker'
"""

from __future__ import annotations

from contract.registry_entries import add_entry, resolve_entry

__all__ = ["TRACKERS", "register_tracker", "tracker_class"]

#: ``metrics.trackers`` name → tracker class, or ``"module:Class"`` resolved by :func:`tracker_class`.
TRACKERS: dict[str, type | str] = {
    "wandb": "cluster.sinks.trackers.wandb_tracker:WandbTracker",
    "mlflow": "cluster.sinks.trackers.mlflow_tracker:MlflowTracker",
    "tensorboard": "cluster.sinks.trackers.tensorboard_tracker:TensorBoardTracker",
    "trackio": "cluster.sinks.trackers.trackio_tracker:TrackioTracker",
}


def register_tracker(name: str, tracker: type | str) -> None:
    """Add a tracker under ``name`` (a ``metrics.trackers`` entry).

    Args:
        tracker: a class implementing :class:`contract.trackers.Tracker`, or ``"module:Class"``.

    Raises:
        ValueError: ``name`` is registered already, or a string ``tracker`` is not ``"module:Class"``.
    """
    add_entry(TRACKERS, "tracker", name, tracker)


def tracker_class(name: str) -> type:
    """The tracker class for the ``metrics.trackers`` entry ``name``; a ``"module:Class"`` entry is imported now
    (the module only: a tracker imports its library when its run opens).

    Raises:
        ValueError: no tracker is registered under ``name`` (the message names ``metrics.trackers`` and the known
            names).
        ImportError, AttributeError: a string entry names a module or class that does not exist.
    """
    if name not in TRACKERS:
        raise ValueError(f"metrics.trackers: {name!r} is not a registered tracker; known: {sorted(TRACKERS)}")
    return resolve_entry(TRACKERS[name])
