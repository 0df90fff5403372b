"""The inline reward pool: the reward functions run in the calling thread, one call at a time, when the calls are
submitted (``reward_pool.workers: 0``, the default). It is the driver's scoring as it always was: each engine's groups
are scored when that engine finishes (the fleet's callback), while the other engines still sample."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cluster.rewards.calls import evaluate_call
from contract.rewards import RewardCall, RewardScores, RewardTicket

__all__ = ["InlineRewardPool"]


class InlineRewardPool:
    """``contract.protocols.RewardPool`` without workers: :meth:`submit` scores every call now (one
    ``grpo.rewards.combine_rewards`` per call), :meth:`collect` hands the scores over.

    Attributes:
        workers: 0.
    """

    workers = 0

    def __init__(self):
        self._ids = itertools.count()
        self._done: dict[int, list[RewardScores]] = {}

    def start(self) -> None:
        pass

    def submit(self, calls: Sequence[RewardCall]) -> RewardTicket:
        """Score ``calls`` now.

        Raises:
            RewardError: a reward function broke its contract, or raised with ``on_error="raise"``.
        """
        ticket = RewardTicket(next(self._ids), tuple(len(c) for c in calls))
        self._done[ticket.ticket_id] = [evaluate_call(c) for c in calls]
        return ticket

    def collect(self, ticket: RewardTicket, timeout_s: float) -> list[RewardScores]:
        """The scores :meth:`submit` computed (``timeout_s`` is not needed: they are ready).

        Raises:
            KeyError: an unknown (or collected) ticket.
        """
        return self._done.pop(ticket.ticket_id)

    def metrics(self) -> dict[str, float]:
        return {}

    def describe(self) -> str:
        return "reward functions in the driver"

    def shutdown(self) -> None:
        self._done.clear()
