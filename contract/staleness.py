"""The one staleness gate of every fleet: a group sampled more than ``rollout.max_staleness`` policy versions behind
the trainer's is refused, the engines are synced again and the groups sampled again with their own seeds (so the same
groups, on the new weights); a fault of the fleet's engines is handed to the fleet's own recovery first.

Both runtimes' fleets (``cluster.ray_shell.fleet.EngineFleet``, ``cluster.in_process.LocalFleet``) run their
``generate`` through :meth:`StalenessGate.run`; what differs between them (how they sample, which errors are engine
faults, how they recover from one, how they resync) comes in as callables. No project imports beyond ``contract``.
"""

from __future__ import annotations

from collections.abc import Callable

from contract.errors import RecoveryDeferred, StaleSamplesError
from contract.figures import FleetFigures
from contract.messages import GroupResult, PoolGenerateStats
from contract.versions import PolicyVersionLedger

__all__ = ["StalenessGate"]


class StalenessGate:
    """Accepts a fleet's groups only within ``rollout.max_staleness`` of the ledger's current version.

    Args:
        versions: the loop's policy-version ledger (``versions.current`` is the trainer's version).
        max_staleness: ``rollout.max_staleness``.
        resync: syncs every engine to ``versions.current``; called with why (``"stale samples"``).
        status: one-line progress messages.
    """

    def __init__(self, versions: PolicyVersionLedger, max_staleness: int, resync: Callable[[str], None],
                 status: Callable[[str], None]):
        self.versions, self.max_staleness = versions, max_staleness
        self.resync, self.status = resync, status

    def run(self, sample: Callable[[], tuple[list[GroupResult], PoolGenerateStats]], *,
            figures: Callable[[], FleetFigures], record: bool, recover: bool, attempts: int,
            faults: tuple[type[BaseException], ...] = (),
            on_fault: Callable[[BaseException], bool] | None = None) -> list[GroupResult]:
        """Call ``sample`` until its groups are fresh enough, at most ``attempts`` times.

        Args:
            sample: one dispatch of the call's requests over the engines: (groups in request order, the call's
                stats).
            figures: the fleet's current step figures; the accepted call's stats are added when ``record``, every
                refused group is counted in ``stale_refused``.
            recover: may resync; False (a generate that overlaps a train step) raises :class:`RecoveryDeferred`
                on stale groups instead.
            faults: the errors that are engine faults; ``on_fault(exc)`` recovers from one (True: sample again) or
                gives up (False: the error propagates); it may raise :class:`RecoveryDeferred` itself (``recover``
                False).

        Raises:
            StaleSamplesError: still stale (or failing) after ``attempts`` calls.
            RecoveryDeferred: with ``recover=False``, stale groups (or ``on_fault``'s).
            PolicyVersionError: a group sampled at a version ahead of the trainer's.
        """
        for _ in range(attempts):
            try:
                groups, stats = sample()
            except faults as exc:
                if on_fault is None or not on_fault(exc):
                    raise
                continue
            stale = [g for g in groups if self.versions.staleness(g.policy_version) > self.max_staleness]
            if not stale:
                if record:
                    figures().add(stats)
                return groups
            if not recover:
                raise RecoveryDeferred(f"{len(stale)} stale group(s) during a generate that overlaps training")
            self.status(f"{len(stale)} group(s) sampled at policy version {min(g.policy_version for g in stale)} "
                        f"(trainer {self.versions.current}, rollout.max_staleness={self.max_staleness}); re-syncing "
                        f"and sampling again")
            figures().stale_refused += len(stale)
            self.resync("stale samples")
        raise StaleSamplesError(f"the engines still returned stale or failed samples after {attempts} attempts "
                                f"(trainer at policy version {self.versions.current}, rollout.max_staleness="
                                f"{self.max_staleness})")
