"""Typed messages between the loop and a reward pool (``contract.protocols.RewardPool``): what to score
(:class:`RewardCall`), a handle on it while it is scored (:class:`RewardTicket`) and the scores
(:class:`RewardScores`).

A call crosses a process boundary (a Ray reward worker, a local worker process): plain data only, every value of
``columns`` and ``prompts`` as the data gave it (strings, numbers, lists, dicts). Scores come back as
:class:`RewardScores` (CPU tensors, built on the caller's side).

Notation: N rows (completions) in a call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["RewardCall", "RewardScores", "RewardTicket"]


@dataclass(frozen=True)
class RewardCall:
    """The weighted reward functions to run on N completions, each with its whole row.

    Attributes:
        completions: N completion texts (EOS stripped).
        references: N reference strings, what ``fn(completions, references)`` functions get.
        prompts: N prompts as the data gave them (a string or a list of ``{role, content}`` messages).
        columns: column name → N values (every column of each completion's row but the prompt; None where a row
            lacks it).
        weights: reward function name (a key of ``grpo.rewards.REWARD_FUNCTIONS``) → weight; the names a worker
            must have loaded. A weight of 0 still runs the function (for its metric).
        on_error: ``algorithm.reward_on_error``: ``"raise"`` (a function that raises fails the step) or ``"none"``
            (its rows of this call get no score).
    """

    completions: list[str]
    references: list[str]
    prompts: list[Any]
    columns: Mapping[str, list[Any]] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    on_error: str = "raise"

    def __len__(self) -> int:
        return len(self.completions)


class RewardScores(NamedTuple):
    """The scores of one :class:`RewardCall` (the same fields as ``grpo.rewards.CombinedRewards``).

    Attributes:
        total: [N] float32, Σ weight · reward over the functions with a nonzero weight; NaN where a weighted function
            gave no score (None, a raise with ``on_error="none"``, or the pool lost the call: an infrastructure
            failure).
        per_function: name → [N] float32 unweighted rewards, NaN for no score.
        num_failed: name → rows whose score that function could not give: it raised (``on_error="none"``), or the
            call was lost (its worker died or timed out, or the pool's wait ran out).
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    num_failed: dict[str, int]


@dataclass(frozen=True)
class RewardTicket:
    """A handle on calls submitted together to a reward pool; :meth:`RewardPool.collect` turns it into their scores.

    Attributes:
        ticket_id: unique within its pool. sizes: N of each call, in submission order.
    """

    ticket_id: int
    sizes: tuple[int, ...]
