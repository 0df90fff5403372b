"""Multi-turn episodes (``rollout.multi_turn``): G episodes per prompt, turn after turn, over the fleet and an
environment host.

    groups = EpisodeRunner(spec, tokenizer, host).run(fleet, requests, examples)   # one GroupResult per request

A round's episodes advance in lockstep: one ``Fleet.generate`` call samples the next turn of every running episode
(each a request of one completion continuing the episode's token ids, ``cluster.loop.episode_state``), then the
environment host answers every finished turn at once (``cluster.loop.environment_host``), and each answer becomes the
episode's observation tokens (``cluster.loop.observation_tokens``: tokenised once, with the template's delimiters) or
its end. An episode ends when its environment says so (``done``), after ``max_turns`` turns, when an observation
would leave no room for another turn in ``max_episode_tokens`` (``token_budget``), or when its environment fails
(``infra_failed``: the episode gets no reward; scoring leaves its row out of the loss and counts it). Each group comes
back as one :class:`contract.messages.GroupResult` of G episodes (``loss_masks``, ``episodes``), scored like G
completions.

Modes and failures:

- The calls take the producer's ``record``/``recover``/``interrupt_epoch``: in ``one_step_off``/``async`` an engine
  fault raises :class:`contract.errors.RecoveryDeferred` (the round is dropped, its prompts drawn again) and a weight
  sync may land between two turns of an episode: every token keeps the version that sampled it, and a group's
  staleness is its oldest sampled token's.
- Partial rollouts: a call interrupted by a weight update raises
  :class:`cluster.loop.partial_rollouts.RoundInterrupted` carrying the round (:class:`EpisodeRound`); the next call
  for the step resumes every episode at the turn it reached, an interrupted turn from its tokens, on the new weights.
- An engine replaced during a call (the fleet recovered from a fault: ``Fleet.restarts`` grew) restarts every episode
  of that call from its start with the same seeds (``EpisodeSummary.restarts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.data import Example, as_example, chat_template_text
from cluster.loop.environment_host import EnvironmentFailure, EnvironmentHost, LocalEnvironments
from cluster.loop.episode_state import Episode, episode_group
from cluster.loop.observation_tokens import ObservationTokens
from cluster.loop.partial_rollouts import RoundInterrupted
from contract.goodput import PoolTime, TimedPool
from contract.messages import GroupRequest, GroupResult
from contract.protocols import Fleet
from grpo.environments import check_observation

__all__ = ["EpisodeRound", "EpisodeRunner", "make_episode_runner"]


class EpisodeRound:
    """The episodes of one sampling round: per request (group), its G :class:`Episode` s.

    Args:
        requests, examples: the round's group requests and their rows (same order).
        group_size: G for a request without its own.
    """

    def __init__(self, requests: Sequence[GroupRequest], examples: Sequence[Example | str], group_size: int):
        self.requests, self.examples = list(requests), [as_example(ex) for ex in examples]
        self.group_size = group_size
        self.episodes: list[list[Episode]] = []
        index = 0
        for k, q in enumerate(self.requests):
            g = q.group_size or group_size
            self.episodes.append([Episode(index + i, k, i, list(q.prompt_ids), q.seed) for i in range(g)])
            index += g

    def all(self) -> list[Episode]:
        """Every episode, group by group."""
        return [e for group in self.episodes for e in group]

    def row(self, group: int) -> dict:
        """What group ``group``'s environments are reset with: every column of its row, ``prompt`` (as the data
        gave it) and ``reference``."""
        ex = self.examples[group]
        return {**dict(ex.columns), "prompt": ex.prompt_as_given, "reference": ex.reference}

    def handles(self) -> list[object]:
        """The open environments' handles (and forgets them: the caller closes them)."""
        out = []
        for e in self.all():
            if e.env is not None:
                out.append(e.env)
                e.env = None
        return out


class EpisodeRunner:
    """Runs multi-turn episodes for the producer and the held-out evaluation (module docstring).

    Args:
        spec: the job spec (``rollout.multi_turn``, ``rollout.max_response_tokens``, ``rollout.group_size``,
            ``data.chat_template``).
        tokenizer: the model's tokenizer (turn texts, observation tokens).
        host: where the environments run.
        status: one-line progress messages (an infrastructure failure's cause, a restart).

    Raises:
        ObservationTokenError: the chat template cannot delimit observations (``data.chat_template``).
    """

    def __init__(self, spec, tokenizer, host: EnvironmentHost, status: Callable[[str], None] = lambda m: None,
                 chat_template: str | None = None):
        self.multi_turn = spec.rollout.multi_turn
        self.group_size = spec.rollout.group_size
        self.turn_tokens = self.multi_turn.turn_tokens(spec.rollout.max_response_tokens)
        self.observations = ObservationTokens(tokenizer, chat_template)
        self.tokenizer, self.host, self._status = tokenizer, host, status

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the environment host's pools, when it reports its time (none else)."""
        return self.host.pool_times() if isinstance(self.host, TimedPool) else []

    def shutdown(self) -> None:
        """Stop the environment host (the job is ending)."""
        self.host.shutdown()

    def decode(self, ids: list[int]) -> str:
        """Token ids → text, special tokens skipped (as the engines decode)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def run(self, fleet: Fleet, requests: list[GroupRequest], examples: Sequence[Example | str], *,
            on_groups: Callable[[list[GroupResult]], None] | None = None, record: bool = True, recover: bool = True,
            interrupt_epoch: int | None = None, carried: EpisodeRound | None = None) -> list[GroupResult]:
        """Run every request's G episodes to their end; one :class:`GroupResult` per request, in order (also given
        to ``on_groups`` once, at the end).

        Args:
            record, recover, interrupt_epoch: ``Fleet.generate``'s, for every turn's call.
            carried: (partial rollouts) the round an interrupted call left; requests with ``resume_from`` continue
                their group's episodes from it, the others start afresh (same seeds).

        Raises:
            RoundInterrupted: a call was interrupted (partial rollouts); it carries the round.
            RecoveryDeferred: the fleet's, with ``recover=False``.
        """
        rnd = self._round(requests, examples, carried)
        try:
            while True:
                self._answer_turns(rnd)
                running = [e for e in rnd.all() if e.ended is None]
                if not running:
                    break
                self._sample_turns(fleet, rnd, running, record, recover, interrupt_epoch)
        except RoundInterrupted:
            raise  # the round, environments included, is carried over
        except BaseException:
            self.host.close(rnd.handles())
            raise
        self.host.close(rnd.handles())
        groups = [episode_group(q, episodes, self.decode) for q, episodes in zip(rnd.requests, rnd.episodes)]
        if on_groups is not None:
            on_groups(groups)
        return groups

    def _round(self, requests: list[GroupRequest], examples: Sequence[Example | str], carried: EpisodeRound | None
               ) -> EpisodeRound:
        """The round to run: fresh episodes, or the carried ones for requests that resume (module docstring)."""
        rnd = EpisodeRound(requests, examples, self.group_size)
        if carried is None:
            return rnd
        kept = {q.group_id: episodes for q, episodes in zip(carried.requests, carried.episodes)}
        for k, q in enumerate(rnd.requests):
            old = kept.pop(q.group_id, None)
            if q.resume_from is not None and old is not None:
                rnd.episodes[k] = old
            elif old is not None:  # sampled again from scratch (too stale): its environments end here
                self.host.close([e.env for e in old if e.env is not None])
        for old in kept.values():
            self.host.close([e.env for e in old if e.env is not None])
        return rnd

    def _sample_turns(self, fleet: Fleet, rnd: EpisodeRound, running: list[Episode], record: bool, recover: bool,
                      interrupt_epoch: int | None) -> None:
        """One generate call: the next (or interrupted) turn of every running episode."""
        mt = self.multi_turn
        calls = [e.request(rnd.requests[e.group], self.turn_tokens, mt.max_episode_tokens) for e in running]
        extra = {} if interrupt_epoch is None else {"interrupt_epoch": interrupt_epoch}
        restarts = fleet.restarts
        results = fleet.generate(calls, record=record, recover=recover, **extra)
        if fleet.restarts != restarts:  # an engine was replaced during the call: back to the episodes' starts
            self.host.close([e.env for e in running if e.env is not None])
            for e in running:
                e.restart()
            self._status(f"{fleet.restarts - restarts} engine(s) replaced during a turn: {len(running)} episode(s) "
                         f"sampled again from their start with the same seeds")
            return
        for e, result in zip(running, results):
            e.take_turn(result, self.decode)
        if any(e.partial is not None for e in running):
            groups = [episode_group(q, episodes, self.decode) for q, episodes in zip(rnd.requests, rnd.episodes)]
            raise RoundInterrupted(rnd.examples, rnd.requests, groups, episodes=rnd)

    def _answer_turns(self, rnd: EpisodeRound) -> None:
        """Every finished turn's environment step: its observation appended, or the episode ended."""
        waiting = [e for e in rnd.all() if e.pending is not None and e.ended is None]
        opening = [e for e in waiting if e.env is None]
        for e, handle in zip(opening, self.host.open([rnd.row(e.group) for e in opening]) if opening else []):
            if isinstance(handle, EnvironmentFailure):
                e.end("infra_failed", handle.message)
            else:
                e.env = handle
        stepping = [e for e in waiting if e.ended is None]
        for e, outcome in zip(stepping, self.host.step([(e.env, e.pending) for e in stepping]) if stepping else []):
            e.environment_s += outcome.seconds
            self._answer(e, outcome.result)
        failed = [e for e in waiting if e.ended == "infra_failed"]
        if failed:
            self._status(f"{len(failed)} episode(s) ended by an environment failure (no reward; counted in "
                         f"reward/infra_failed), e.g. episode {failed[0].sample} of group {failed[0].group}: "
                         f"{failed[0].detail}")

    def _answer(self, e: Episode, result) -> None:
        """Apply one environment step's result to episode ``e``."""
        mt = self.multi_turn
        if isinstance(result, EnvironmentFailure):
            e.end("infra_failed", result.message)
            return
        problem = check_observation(result)
        if problem is not None:  # a host that does not check its environments' answers
            e.end("infra_failed", f"the environment's step returned {problem}")
            return
        e.tool_calls += result.tool_calls
        e.tool_errors += result.tool_errors
        e.turn_reward += float(result.reward) if result.reward is not None else 0.0
        if result.done:
            e.end("done")
            return
        if e.turns >= mt.max_turns:
            e.end("max_turns")
            return
        try:
            ids = self.observations.ids(result.role, result.text, e.pending.token_ids)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render the role: no episode can go on
            e.end("infra_failed", f"the chat template cannot render a {result.role!r} observation: "
                                  f"{type(exc).__name__}: {exc}")
            return
        if len(e.ids) + len(ids) + 1 > mt.max_episode_tokens:
            e.end("token_budget")
            return
        e.observe(ids)
        e.pending = None


def make_episode_runner(spec, tokenizer, status: Callable[[str], None] = lambda m: None) -> EpisodeRunner | None:
    """The job's :class:`EpisodeRunner` with its environments in this process (:class:`LocalEnvironments`); None
    without ``rollout.multi_turn`` or with its ``runner: agent_pool`` (``cluster.loop.agent_episodes``).

    Raises:
        ObservationTokenError: the chat template cannot delimit observations (``data.chat_template``).
    """
    mt = spec.rollout.multi_turn
    if mt is None or mt.runner != "lock_step":
        return None
    host = LocalEnvironments(mt.environment, mt.options, mt.parallel, mt.step_timeout_s)
    return EpisodeRunner(spec, tokenizer, host, status, chat_template=chat_template_text(spec.data))
