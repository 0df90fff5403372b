"""What the driver samples each step: the rollout batch, DAPO dynamic sampling, and the adaptive group size.

Shapes: B prompts per step (``rollout.prompts_per_step``), G completions per prompt, N sequences (rows).

- :class:`RolloutBatch` is the typed, row-aligned result of generate → score → advantages for a set of groups; rows of
  one group share a ``group_ids`` entry, unique within a step.
- :func:`sample_groups` runs sampling rounds. Without dynamic sampling: one round of B prompts, every group kept.
  With it (Yu et al. 2025, "DAPO", §3.2 dynamic sampling): groups whose advantages are all zero (all-equal rewards:
  no learning signal) are dropped and further rounds sample prompts until B informative groups are kept or
  ``max_rounds`` rounds have run.
- :class:`GroupSizeController` gives G per step: a schedule by step (seed: G = 8 early, 16 later) and an optional
  rise when too many groups are all-equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from contract.batches import RolloutBatch

__all__ = ["GroupSizeController", "SamplingResult", "informative_group_ids", "sample_groups", "scored_group_count"]


def informative_group_ids(advantages: torch.Tensor, group_ids: torch.Tensor) -> list[int]:
    """Ids of the groups with at least one nonzero advantage, in order of first appearance."""
    seen: dict[int, bool] = {}
    for gid, adv in zip(group_ids.tolist(), advantages.tolist()):
        seen[gid] = seen.get(gid, False) or adv != 0.0
    return [gid for gid, informative in seen.items() if informative]


def scored_group_count(rewards: torch.Tensor, group_ids: torch.Tensor) -> int:
    """Groups with at least one completion that has a reward (not NaN): a group whose every completion is an
    infrastructure failure (``cluster.loop.scoring``) counts as if it had not been sampled."""
    return int(torch.unique(group_ids[~rewards.isnan()]).numel())


@dataclass
class SamplingResult:
    """batch: the groups to train on. sampled: every group sampled this step (for reward/length metrics).
    rounds: sampling rounds used. all_equal_fraction: fraction of sampled groups whose advantages are all zero
    (groups without any reward, all infrastructure failures, are not counted)."""

    batch: RolloutBatch
    sampled: RolloutBatch
    rounds: int
    all_equal_fraction: float

    @property
    def num_groups_sampled(self) -> int:
        return int(torch.unique(self.sampled.group_ids).numel())


def sample_groups(sample_round: Callable[[int], RolloutBatch], prompts_per_step: int, *, dynamic: bool = False,
                  max_rounds: int = 1) -> SamplingResult:
    """Run sampling rounds until the step's batch is complete.

    Args:
        sample_round: ``k → RolloutBatch`` of k new prompts' groups (generated, scored, with advantages); group ids
            must be unique across the calls of one step.
        prompts_per_step: B, the number of groups to train on.
        dynamic: DAPO dynamic sampling. Round 1 samples B prompts; each later round samples
            min(B, ⌈missing / rate⌉) prompts, rate being the informative-group fraction seen so far (B when 0).
            Groups with all advantages 0 are dropped; informative groups beyond B are dropped (latest first). When
            ``max_rounds`` rounds end with fewer than B informative groups, those are trained on; with none at all,
            the last round's groups are kept (their advantages are 0: only the KL and entropy terms act) so the
            step still yields a policy version.
        max_rounds: bound on rounds, ≥ 1 (only used when ``dynamic``).

    Returns:
        `SamplingResult`.

    Raises:
        ValueError: prompts_per_step or max_rounds < 1.
    """
    if prompts_per_step < 1 or max_rounds < 1:
        raise ValueError(f"expected prompts_per_step >= 1 and max_rounds >= 1, got {prompts_per_step}, {max_rounds}")
    rounds: list[RolloutBatch] = []
    kept_rows: list[tuple[int, list[int]]] = []  # (round index, rows of one informative group)
    sampled_groups = informative_seen = 0
    while True:
        missing = prompts_per_step - len(kept_rows)
        rate = informative_seen / sampled_groups if sampled_groups else 1.0
        k = prompts_per_step if not rounds or rate == 0 else min(prompts_per_step, math.ceil(missing / rate))
        batch = sample_round(k)
        rounds.append(batch)
        groups = informative_group_ids(batch.advantages, batch.group_ids)
        sampled_groups += scored_group_count(batch.rewards, batch.group_ids)
        informative_seen += len(groups)
        gids = batch.group_ids.tolist()
        for gid in groups[:max(0, missing)]:
            kept_rows.append((len(rounds) - 1, [i for i, g in enumerate(gids) if g == gid]))
        if not dynamic or len(kept_rows) >= prompts_per_step or len(rounds) >= max_rounds:
            break
    sampled = RolloutBatch.concat(rounds)
    all_equal = 1.0 - informative_seen / max(sampled_groups, 1)
    if not dynamic:
        return SamplingResult(batch=rounds[0], sampled=sampled, rounds=1, all_equal_fraction=all_equal)
    if not kept_rows:
        return SamplingResult(batch=rounds[-1], sampled=sampled, rounds=len(rounds), all_equal_fraction=all_equal)
    parts = [rounds[r].select(rows) for r, rows in kept_rows]
    batch = RolloutBatch.concat(parts)
    batch.num_failed, batch.num_not_applicable = sampled.num_failed, sampled.num_not_applicable
    return SamplingResult(batch=batch, sampled=sampled, rounds=len(rounds), all_equal_fraction=all_equal)


class GroupSizeController:
    """G per step: a schedule by step, raised adaptively when too many groups carry no signal.

        G(step) = max(scheduled(step), raised)
        scheduled(step) = G of the last schedule entry with entry step ≤ step, else ``base``
        after a step whose all-equal fraction > threshold:  raised ← min(2·G(step), max_size)

    G never falls below the schedule and the raise is never undone (the all-equal fraction falls as G grows, which
    must not shrink G again). Seed: G = 8 early, 16 later, e.g. ``schedule=[(1, 8), (100, 16)]``.

    Args:
        base: G before the first schedule entry (``rollout.group_size``), ≥ 2.
        schedule: (step, G) pairs, steps strictly increasing and ≥ 1, G ≥ 2.
        max_size: upper bound of the adaptive rise; None disables it.
        rise_threshold: all-equal fraction in (0, 1] above which G rises.
    """

    def __init__(self, base: int, schedule: Sequence[tuple[int, int]] = (), max_size: int | None = None,
                 rise_threshold: float = 0.5):
        steps = [s for s, _ in schedule]
        if base < 2 or any(g < 2 for _, g in schedule):
            raise ValueError(f"group sizes must be >= 2, got base {base} and schedule {list(schedule)}")
        if any(s < 1 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"schedule steps must be >= 1 and strictly increasing, got {steps}")
        if max_size is not None and max_size < 2:
            raise ValueError(f"max_size must be >= 2 or None, got {max_size}")
        if not 0.0 < rise_threshold <= 1.0:
            raise ValueError(f"rise_threshold must be in (0, 1], got {rise_threshold}")
        self.base, self.schedule = base, [(int(s), int(g)) for s, g in schedule]
        self.max_size, self.rise_threshold = max_size, rise_threshold
        self.raised = 0

    def scheduled(self, step: int) -> int:
        """G from the schedule alone."""
        g = self.base
        for start, size in self.schedule:
            if start <= step:
                g = size
        return g

    def group_size(self, step: int) -> int:
        """G to sample at ``step`` (1-based)."""
        return max(self.scheduled(step), self.raised)

    def observe(self, step: int, all_equal_fraction: float) -> None:
        """Record the all-equal group fraction measured at ``step``; may raise G for later steps."""
        if self.max_size is not None and all_equal_fraction > self.rise_threshold:
            self.raised = max(self.raised, min(2 * self.group_size(step), self.max_size))

    def state_dict(self) -> dict:
        return {"raised": self.raised}

    def load_state_dict(self, state: dict) -> None:
        self.raised = int(state["raised"])
