"""Partial rollouts on the driver's side (``rollout.partial_rollout``, ``rollout.mode: async``): the one owner of the
sampling round an interrupted producer call leaves behind, of the interrupt epoch, and of the ``rollout/partial_*``
counts.

After each train step the async schedule (:class:`cluster.loop.overlap.AsyncSchedule`) interrupts the producer's
generate call instead of waiting for its longest completion: every engine aborts its unfinished requests
(``RolloutEngine.interrupt``, :mod:`rollout_workers.partial`) and returns them with their tokens so far. The driver
keeps that round — its prompts, the data position before they were drawn, its requests each carrying its interrupted
group (``GroupRequest.resume_from``) — as a :class:`CarriedRound`, and the next generate call for the same step
(after the weight sync, on the new weights) sends those requests again instead of drawing new prompts: complete groups
come back as they were, interrupted completions are continued from their tokens. Complete groups are only those whose
G completions all finished; nothing is scored or trained before.

Invariants (as for batches queued by the producer): a carried round is in flight. A checkpoint taken while one exists
records the data position before its prompts were drawn (they are sampled again from scratch on resume and counted in
``rollout/inflight_resampled``); a rollback, a stale-queue drop or a resume discards it (its prompts are drawn again
from the restored position); so no prompt is lost or trained twice.

Staleness: a carried group's ``policy_version`` is the oldest version of any of its tokens. A group that would be
more than ``rollout.max_staleness`` versions behind the policy that trains it is sampled again from scratch (same
seed) instead of continued, counted in ``rollout/partial_restarted``: a long completion interrupted step after step
never outgrows the staleness bound.

Sources: AReaL (Fu et al. 2025, interruptible rollout workers), PipelineRL (Piché et al. 2025, in-flight weight
updates), slime (THUDM, partial rollouts: aborted samples kept and continued in the next rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cluster.data import Example
from contract.figures import FleetFigures
from contract.batches import RolloutBatch
from contract.messages import INTERRUPTED, GroupRequest, GroupResult

__all__ = ["CarriedRound", "PartialRollouts", "RoundInterrupted", "older_token_fraction"]


class RoundInterrupted(Exception):
    """A sampling round's generate call was interrupted (partial rollouts): ``groups`` (request order) hold at least
    one ``"interrupted"`` completion. Raised by the driver's sampling round, turned into a :class:`CarriedRound`."""

    def __init__(self, examples: list[Example], requests: list[GroupRequest], groups: list[GroupResult],
                 episodes: object | None = None):
        super().__init__(f"{sum(not g.complete for g in groups)} of {len(groups)} group(s) interrupted")
        self.examples, self.requests, self.groups = examples, requests, groups
        self.episodes = episodes  # multi-turn: the round's episodes (cluster.loop.episodes.EpisodeRound), else None


@dataclass
class CarriedRound:
    """An interrupted sampling round, kept for the next generate call of the same step.

    Attributes:
        step: the step it samples for. position: the data position and group-size controller state before its
            prompts were drawn (``StepBatch.position``'s form). group_size: G. examples: its prompts' examples.
        requests: its requests, each with ``resume_from`` = its group as the interrupted call returned it.
        figures: the fleet's figures of the calls made for it so far.
        episodes: (multi-turn) its episodes as the interrupted call left them (turns, environments, tokens):
            a request whose ``resume_from`` is kept continues its group's episodes at the turn they reached; None
            for single completions.
    """

    step: int
    position: dict
    group_size: int
    examples: list[Example]
    requests: list[GroupRequest]
    figures: FleetFigures
    episodes: object | None = None

    @property
    def num_groups(self) -> int:
        return len(self.requests)


class PartialRollouts:
    """The carried round, the interrupt epoch and the step's counts.

    Args:
        max_staleness: ``rollout.max_staleness`` (>= 1 in async mode).

    Attributes:
        carried: the round an interrupted producer call left, or None.
        epoch: the interrupt epoch of the running step's producer calls (``RolloutEngine.generate``'s
            ``interrupt_epoch``); raised by :meth:`begin_step`, never lowered (a rollback keeps raising it), so an
            interrupt of one step never stops a later step's calls.
        interrupted, resumed, restarted: completions interrupted, completions continued from their tokens, and
            carried groups sampled again from scratch, since the last :meth:`metrics`.
    """

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.carried: CarriedRound | None = None
        self.epoch = 0
        self.interrupted = self.resumed = self.restarted = 0

    def begin_step(self) -> int:
        """A new step: its producer calls get a new epoch (returned)."""
        self.epoch += 1
        return self.epoch

    def carry(self, step: int, position: dict, group_size: int, interrupted: RoundInterrupted,
              figures: FleetFigures) -> CarriedRound:
        """Keep the interrupted round of ``step`` (the one before it is dropped: only one call is ever in flight).

        Raises:
            ValueError: a round is carried already for another step (it should have been resumed or discarded).
        """
        if self.carried is not None and self.carried.step != step:
            raise ValueError(f"step {step}: a round of step {self.carried.step} is carried over already; discard() it "
                             f"first")
        requests = [replace(q, resume_from=g) for q, g in zip(interrupted.requests, interrupted.groups)]
        self.interrupted += sum(g.finish_reasons.count(INTERRUPTED) for g in interrupted.groups)
        self.carried = CarriedRound(step, position, group_size, interrupted.examples, requests, figures,
                                    interrupted.episodes)
        return self.carried

    def take(self, step: int, trained_at: int) -> CarriedRound | None:
        """The carried round of ``step`` (removed from here), its requests ready to send: a group whose oldest
        token would be more than ``max_staleness`` versions behind ``trained_at`` (the earliest policy version that
        can train it: the trainer's now, plus one per step between) is sampled again from scratch (``resume_from``
        None); None when no round of ``step`` is carried (one of another step stays).
        """
        carried = self.carried
        if carried is None or carried.step != step:
            return None
        self.carried = None
        requests = []
        for q in carried.requests:
            prior = q.resume_from
            if trained_at - prior.policy_version > self.max_staleness:
                self.restarted += 1
                requests.append(replace(q, resume_from=None))
                continue
            self.resumed += prior.finish_reasons.count(INTERRUPTED)
            requests.append(q)
        return replace(carried, requests=requests)

    def discard(self) -> CarriedRound | None:
        """Drop the carried round (rollback, resume, stale-queue drop); returns it (None when there was none)."""
        carried, self.carried = self.carried, None
        return carried

    def metrics(self, trained: RolloutBatch) -> dict:
        """The step's ``rollout/partial_*`` metrics: completions interrupted (``partial_interrupted``), continued
        from their tokens (``partial_resumed``) and carried groups sampled again from scratch (``partial_restarted``)
        since the last call (then reset); groups carried over to the next step (``partial_carried_groups``); and the
        fraction of the ``trained`` batch's loss tokens sampled by an older version than their trajectory's newest
        (``partial_older_token_fraction``, :func:`older_token_fraction`)."""
        versions = trained.token_versions or [[v] * len(r) for v, r in zip(trained.versions, trained.response_ids)]
        lengths = trained.valid_lengths
        if trained.loss_masks is not None:  # multi-turn: the tokens that count in the loss, observations left out
            versions = [[v for v, m in zip(vs, trained.loss_mask(i).tolist()) if m] for i, vs in enumerate(versions)]
            lengths = [len(v) for v in versions]
        out = {"rollout/partial_interrupted": self.interrupted, "rollout/partial_resumed": self.resumed,
               "rollout/partial_restarted": self.restarted,
               "rollout/partial_carried_groups": self.carried.num_groups if self.carried is not None else 0,
               "rollout/partial_older_token_fraction": older_token_fraction(versions, lengths)}
        self.interrupted = self.resumed = self.restarted = 0
        return out


def older_token_fraction(token_versions: list[torch.Tensor | list[int]], valid_lengths: list[int]) -> float:
    """The fraction of trained tokens sampled by an older policy version than their trajectory's newest token.

    Args:
        token_versions: N rows of R_i versions (ints) of each response token. valid_lengths: N, the tokens of each
            row that count in the loss (the first ``valid_lengths[i]``).

    Returns:
        Σ_i #{t < L_i: v_it < max_t' v_it'} / Σ_i L_i (the newest over the row's counted tokens); 0.0 when no token
        counts.
    """
    older = total = 0
    for versions, length in zip(token_versions, valid_lengths):
        v = torch.as_tensor(list(versions)[:length], dtype=torch.int64)
        if v.numel():
            older += int((v < v.max()).sum())
            total += int(v.numel())
    return older / total if total else 0.0
