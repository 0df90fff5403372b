"""The policy version's one owner: the trainer's latest version and the version each synced engine holds.

A policy version counts the optimizer steps applied to the policy: 0 is the initial model (or the checkpoint's
version on resume) and every train step that applies an update adds one. Everyone else reports to the ledger and is
checked against it:

* the trainer, after each train step (:meth:`PolicyVersionLedger.trained`: the same version when every update was
  skipped, else one more);
* the weight sync, when its group changes (:meth:`~PolicyVersionLedger.set_engines`), after a sync
  (:meth:`~PolicyVersionLedger.synced`, with each engine's ``ReceiveReport.policy_version``) and after a failed one
  (:meth:`~PolicyVersionLedger.sync_failed`);
* the engines' own reports (``EngineInfo.policy_version``, each group's ``GroupResult.policy_version``), which can
  never be ahead of the trainer (:meth:`~PolicyVersionLedger.check_engine`, :meth:`~PolicyVersionLedger.staleness`).

Engines are identified by their handle (the Ray actor handle), so one that stays in a rebuilt group keeps its version.
"""

from __future__ import annotations

from collections.abc import Sequence


class PolicyVersionError(RuntimeError):
    """A reported policy version contradicts the ledger (states the expected and the reported version)."""


class PolicyVersionLedger:
    """The trainer's latest policy version and the version each engine of the weight-sync group holds.

    Args:
        current: the trainer's version to start from (0, or the checkpoint's version on resume).

    Attributes:
        current: the trainer's latest policy version (read-only).
        engine_versions: per engine of the sync group, in group order, the version it holds (None: unknown, i.e.
            new to the group or after a failed sync).
    """

    def __init__(self, current: int = 0):
        if current < 0:
            raise PolicyVersionError(f"policy version must be >= 0, got {current}")
        self._current = int(current)
        self._engines: list = []
        self._engine_versions: list[int | None] = []

    @property
    def current(self) -> int:
        return self._current

    @property
    def engine_versions(self) -> list[int | None]:
        return list(self._engine_versions)

    def restore(self, current: int) -> None:
        """Rewind to ``current``, the policy version of a checkpoint the job returns to (resume, guard rollback):
        the trainer's version is reset and no engine is known to hold any version until the next sync.

        Raises:
            PolicyVersionError: ``current`` < 0.
        """
        if current < 0:
            raise PolicyVersionError(f"policy version must be >= 0, got {current}")
        self._current = int(current)
        self._engines, self._engine_versions = [], []

    # ---- the trainer ------------------------------------------------------------------------------------------
    def trained(self, version: int) -> bool:
        """The trainer reports ``version`` after a train step; returns whether the policy advanced (a step whose
        updates were all skipped reports the version it had).

        Raises:
            PolicyVersionError: ``version`` is below :attr:`current` or more than one above it.
        """
        if version == self._current:
            return False
        if version != self._current + 1:
            raise PolicyVersionError(f"trainer reported policy version {version} after a train step at version "
                                     f"{self._current}; expected {self._current} (skipped) or {self._current + 1}")
        self._current = version
        return True

    def check_trainer(self, version: int) -> None:
        """The trainer says it holds ``version`` (e.g. when it sends the weights).

        Raises:
            PolicyVersionError: ``version`` is not :attr:`current`.
        """
        if version != self._current:
            raise PolicyVersionError(f"trainer is at policy version {version}, expected {self._current}")

    # ---- the engines ------------------------------------------------------------------------------------------
    def check_engine(self, version: int | None, who: str) -> None:
        """An engine (``who``) reports holding ``version`` (``EngineInfo.policy_version``; None: unknown).

        Raises:
            PolicyVersionError: ``version`` is ahead of the trainer's.
        """
        if version is not None and version > self._current:
            raise PolicyVersionError(f"{who} reports policy version {version}, ahead of the trainer's "
                                     f"{self._current}")

    def staleness(self, version: int) -> int:
        """How many versions the policy that sampled a group (``GroupResult.policy_version``) is behind the
        trainer's: :attr:`current` − ``version``, >= 0.

        Raises:
            PolicyVersionError: ``version`` is ahead of the trainer's.
        """
        self.check_engine(version, "a sampled group")
        return self._current - version

    def set_engines(self, engines: Sequence) -> None:
        """The sync group's members are now ``engines`` (handles, in group order): one already in the group keeps
        the version it holds, a new one is unknown until a sync brings it to the current policy."""
        known = {id(e): v for e, v in zip(self._engines, self._engine_versions)}
        self._engines = list(engines)
        self._engine_versions = [known.get(id(e)) for e in self._engines]

    def synced(self, version: int, reported: Sequence[int | None]) -> None:
        """A sync of ``version`` to every engine of the group finished; ``reported`` holds each engine's
        ``ReceiveReport.policy_version``, in group order.

        Raises:
            PolicyVersionError: ``version`` is not :attr:`current`, the number of reports is not the number of
                engines, or an engine reports another version (naming it).
        """
        if version != self._current:
            raise PolicyVersionError(f"synced policy version {version}, but the trainer is at {self._current}")
        if len(reported) != len(self._engines):
            raise PolicyVersionError(f"{len(reported)} engine report(s) for a group of {len(self._engines)} engine(s)")
        wrong = [f"engine {i} reports {v}" for i, v in enumerate(reported) if v != version]
        if wrong:
            raise PolicyVersionError(f"after a sync of policy version {version}: {', '.join(wrong)}")
        self._engine_versions = list(reported)

    def sync_failed(self) -> None:
        """A sync failed part-way: every engine of the group may hold a partial load, so its version is unknown."""
        self._engine_versions = [None] * len(self._engines)

    def stale_engines(self) -> list[int]:
        """Indices (in group order) of engines that do not hold :attr:`current` (new, or after a failed sync)."""
        return [i for i, v in enumerate(self._engine_versions) if v != self._current]
