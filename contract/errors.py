"""Errors a collaborator raises to the loop and the loop acts on (not only reports)."""

from __future__ import annotations

__all__ = ["RecoveryDeferred", "StaleSamplesError"]


class RecoveryDeferred(RuntimeError):
    """A generate call that may not sync engines (``recover=False``: it overlaps a train step, whose weights are
    changing, ``rollout.mode`` one_step_off or async) met an engine fault or stale groups. Nothing was recovered; the
    caller drops the call's groups and samples them again once the train step has ended and the weights are synced."""


class StaleSamplesError(RuntimeError):
    """The fleet's engines kept returning groups older than ``rollout.max_staleness`` (or failed samples) after being
    synced again (``contract.staleness.StalenessGate``); the job stops naming the versions."""
