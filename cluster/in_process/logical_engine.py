"""The in-process fleet's logical engines: the handles the policy-version ledger records a version for and the
per-engine figures name, each a share of the dispatch over the fleet's one hf engine."""

from __future__ import annotations

__all__ = ["LocalEngine"]


class LocalEngine:
    """One logical engine of a :class:`LocalFleet`: a share of the dispatch over the fleet's one engine, and the
    handle the ledger records a version for.

    Attributes:
        index: its position in the fleet (``engine-<index>`` in the per-engine figures).
    """

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"LocalEngine({self.index})"
