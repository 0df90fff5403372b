"""One step's batch, produced: draw prompts → generate groups → score → advantages (repeated by dynamic sampling),
on the fleet's current weights.

:class:`BatchProducer` is the one owner of the data position (the prompt queue and the group-size controller) and of
the round an interrupted producer call leaves behind (partial rollouts): the loop asks it for a step's
:class:`~cluster.loop.step_metrics.StepBatch`, to rewind to a batch's position (a dropped stale queue), and for the
position a checkpoint records. It calls the fleet (``contract.protocols.Fleet``), the scorer and the reward pool
(``contract.protocols.RewardPool``), nothing else.

Threads: in ``rollout.mode`` one_step_off and async the schedule calls :meth:`BatchProducer.produce` for later steps
in its producer thread while the trainer works: it uses the fleet, the prompt queue, the scorer, the reward pool and
the group-size controller, which nothing else touches then, and it syncs no engine (``recover=False``: the trainer's
weights are changing).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from cluster.loop.episodes import EpisodeRunner
from cluster.loop.goodput import DriverClock
from cluster.loop.overlap import GenerateInterrupted
from cluster.loop.partial_rollouts import PartialRollouts, RoundInterrupted
from cluster.loop.requests import PromptQueue
from cluster.loop.sampling import GroupSizeController, sample_groups
from cluster.loop.scoring import RoundScorer, Scoring
from cluster.rewards.inline import InlineRewardPool
from cluster.loop.step_metrics import StepBatch, StepClock
from contract.batches import RolloutBatch
from contract.errors import RecoveryDeferred
from contract.protocols import Fleet, RewardPool

__all__ = ["BatchProducer", "batch_version"]


def batch_version(batch: StepBatch) -> int:
    """The oldest policy version that sampled a row of ``batch`` (what its staleness is measured from)."""
    return min(int(v) for v in batch.sampling.batch.versions)


class BatchProducer:
    """Produces each step's :class:`StepBatch` from the prompt queue, the fleet and the scorer.

    Args:
        spec: the job spec (``rollout.prompts_per_step``, ``algorithm.dynamic_sampling``/``max_sampling_rounds``,
            ``rollout.partial_rollout``, ``rollout.max_staleness``).
        requests: the prompt queue (data position, group ids and seeds).
        scoring: rewards, masks and advantages.
        group_size: G per step.
        status: one-line progress messages.
        reward_pool: where the reward functions run (each engine's groups are submitted as they arrive); None: in
            the calling thread (``cluster.rewards.inline.InlineRewardPool``).
        fleet: the rollout side (started by the job before the first :meth:`produce`); None only for a job that
            checks its inputs and never runs (``dry_run``).
        episodes: (``rollout.multi_turn``) runs each round's groups as multi-turn episodes over the fleet; None: one
            completion per sample.
        driver_clock: counts the driver's waits on the engines and the reward pool (``cluster.loop.goodput``);
            None: a clock of its own, read by nobody.

    Attributes:
        partial: (``rollout.partial_rollout``) the carried round, interrupt epoch and ``rollout/partial_*`` counts;
            None otherwise.
    """

    def __init__(self, spec, requests: PromptQueue, scoring: Scoring, group_size: GroupSizeController,
                 status: Callable[[str], None], reward_pool: RewardPool | None = None, *, fleet: Fleet | None,
                 episodes: EpisodeRunner | None = None, driver_clock: DriverClock | None = None):
        self.spec, self.requests, self.scoring, self.group_size, self._status = (spec, requests, scoring, group_size,
                                                                               status)
        self.driver_clock = driver_clock if driver_clock is not None else DriverClock()
        self.reward_pool = reward_pool if reward_pool is not None else InlineRewardPool()
        self.fleet, self.episodes = fleet, episodes
        r = spec.rollout
        self.partial = PartialRollouts(r.max_staleness) if r.partial_rollout else None

    # ---- the data position ----------------------------------------------------------------------------------------
    def position(self) -> dict:
        """The data position now: ``{"prompts": PromptQueue.state_dict(), "group_size": ...state_dict()}``."""
        return {"prompts": self.requests.state_dict(), "group_size": self.group_size.state_dict()}

    def rewind(self, position: dict) -> None:
        """Go back to ``position`` (:meth:`position`'s form, e.g. a dropped batch's): its prompts are drawn again
        in the same order; a carried round (drawn after it) is dropped."""
        self.requests.load_state_dict(position["prompts"])
        self.group_size.load_state_dict(position["group_size"])
        self.discard_carried()

    def discard_carried(self) -> None:
        """Drop the round carried over by partial rollouts (a rollback, a resume, a stale-queue drop)."""
        if self.partial is not None:
            self.partial.discard()

    def carried(self):
        """The round carried over by partial rollouts (``CarriedRound``), None when there is none."""
        return self.partial.carried if self.partial is not None else None

    # ---- partial rollouts -----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: the producer calls it makes get a new interrupt epoch (partial rollouts)."""
        if self.partial is not None:
            self.partial.begin_step()

    def interrupt(self) -> None:
        """(partial rollouts) Stop this step's producer calls on every engine (the schedule's ``interrupt``)."""
        self.fleet.interrupt(self.partial.epoch)

    def partial_metrics(self, trained: RolloutBatch) -> dict:
        """The step's ``rollout/partial_*`` metrics; {} without partial rollouts."""
        return self.partial.metrics(trained) if self.partial is not None else {}

    # ---- producing ------------------------------------------------------------------------------------------------
    def produce(self, step: int, trainer_version: int, overlapped: bool, bar=None) -> StepBatch:
        """generate → score → advantages for step ``step`` (repeated by dynamic sampling), on the engines' current
        weights.

        Args:
            trainer_version: the earliest policy version that can train this batch (the trainer's now, plus one per
                step between): a carried round's groups staler than ``rollout.max_staleness`` behind it are sampled
                again from scratch.
            overlapped: the call runs while a train step does (one_step_off/async prefetch): no engine is replaced
                or synced, and the call may be interrupted (partial rollouts).
            bar: a progress bar to show the phase on (None: none).

        Raises:
            RecoveryDeferred: (overlapped only) an engine fault; the prompts drawn are put back, to be drawn again
                by the next step after the sync.
            GenerateInterrupted: (partial rollouts, overlapped only) the call was interrupted; its round is carried
                over to the next call for the same step.
        """
        clock = StepClock(bar)
        carried = self.partial.take(step, trainer_version) if self.partial is not None else None
        position = carried.position if carried is not None else self.position()
        group_size = carried.group_size if carried is not None else self.group_size.group_size(step)
        self.requests.begin_step(step)
        self.fleet.begin_step(carried.figures if carried is not None else None)
        if carried is not None:
            self.requests.redraw(carried.examples, carried.requests)
        epoch = self.partial.epoch if self.partial is not None and overlapped else None
        sample_round = partial(self._sample_round, group_size, clock, not overlapped, carried=carried,
                               interrupt_epoch=epoch)
        alg = self.spec.algorithm
        try:
            sampling = sample_groups(sample_round, self.spec.rollout.prompts_per_step, dynamic=alg.dynamic_sampling,
                                     max_rounds=alg.max_sampling_rounds)
        except RecoveryDeferred as exc:
            self.requests.load_state_dict(position["prompts"])
            self._status(f"step {step}'s batch: {exc}")
            raise
        except RoundInterrupted as exc:
            self.partial.carry(step, position, group_size, exc, self.fleet.figures)
            raise GenerateInterrupted(f"step {step}'s batch: {exc}") from None
        self.group_size.observe(step, sampling.all_equal_fraction)
        return StepBatch(step=step, sampling=sampling, group_size=group_size,
                         prompts=self.requests.trained_prompts(sampling.batch.group_ids), fleet=self.fleet.figures,
                         seconds={"generate": clock.seconds["generate"], "score": clock.seconds["score"]},
                         position=position)

    def _sample_round(self, group_size: int, clock: StepClock, recover: bool, num_prompts: int,
                      carried=None, interrupt_epoch: int | None = None) -> RolloutBatch:
        """generate → score → advantages for ``num_prompts`` new prompts of G = ``group_size`` completions each;
        each engine's groups are scored as soon as it finishes. ``recover``: :meth:`Fleet.generate`'s. Partial
        rollouts: ``carried`` (a ``CarriedRound``) replaces the draw; ``interrupt_epoch`` makes the call interruptible.

        Raises:
            RoundInterrupted: a group came back with an interrupted completion (nothing was scored).
        """
        clock.show("generate")
        examples, requests = ((carried.examples, carried.requests) if carried is not None
                              else self.requests.draw(num_prompts, group_size))
        scorer = RoundScorer(self.scoring, requests, examples, self.reward_pool, self.spec.rollout.timeout_s,
                             driver_clock=self.driver_clock)
        extra = {"interrupt_epoch": interrupt_epoch} if interrupt_epoch is not None else {}
        with clock.measure("generate"), self.driver_clock.waiting():
            if self.episodes is not None:  # raises RoundInterrupted itself, carrying its episodes
                groups = self.episodes.run(self.fleet, requests, examples, on_groups=scorer.on_groups,
                                           recover=recover, carried=carried.episodes if carried else None, **extra)
            else:
                groups = self.fleet.generate(requests, scorer.on_groups, recover=recover, **extra)
        if not all(g.complete for g in groups):
            raise RoundInterrupted(examples, requests, groups)
        clock.add("score", scorer.seconds)
        with clock.phase("score"):
            return scorer.batch(groups)
