"""Agent episodes (``rollout.agent``, or an environment with ``rollout.multi_turn.runner: agent_pool``): G episodes
per group request, each opened on the endpoint, run on the agent pool and closed when its outcome arrives.

    runner = AgentEpisodeRunner(spec, endpoint, pool, decode, current_version)
    groups = runner.run(fleet, requests, examples, on_groups=scorer.on_groups)   # one GroupResult per request

Every episode of every group is submitted at once; the pool runs them concurrently (many per worker), and the
endpoint serves each call the moment it is made, so no episode waits for another. A group is formed the moment its
G episodes have ended and handed to ``on_groups`` at once (its rewards are scored while other groups still run).

Seeds: episode i of a group seeded s is opened with ``seed=s + i`` (the seed of completion i of a single-turn group,
so an episode of one call is that completion; the endpoint seeds its later calls from it) and ``sample=i``. A
group's sequences are built from the endpoint's records (``cluster.loop.agent_sequences``): one per run of calls
that extend each other; an episode whose agent rewrote its history is several sequences sharing its reward and
advantage (``GroupResult.episode_of``; ``cluster.loop.scoring``).

How an episode ends (``EpisodeSummary.ended``; docs/agents.md):

- the agent returned: ``done`` (the environment kind: ``done``, ``max_turns`` or ``token_budget``), its reward the
  ``turn_reward`` (``reward/agent``, or ``reward/environment`` for the environment kind), NaN when it returned None;
- a policy failure (a call refused for the episode's token budget): ``token_budget``, reward 0, trained;
- an infrastructure failure (the agent raised, hung, returned a non-number; its worker died; an engine aborted one of
  its calls; it made no model call; it did not end within ``rollout.timeout_s``): ``infra_failed``, no reward
  (excluded from the loss and its group's statistics, counted in ``reward/infra_failed``). An episode without
  calls is kept as one placeholder row of one masked token so that it is counted like the others.

Every failure is said in one line per distinct reason (``status``); nothing raises for an agent's fault. What
raises is the endpoint's own failure (it cannot open an episode): the step fails as a generate call would.
"""

from __future__ import annotations

import itertools
import math
import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from cluster.data import Example, as_example
from cluster.loop.agent_sequences import AgentRecordError, AgentSequence, agent_sequences
from cluster.loop.setup import SetupError
from cluster.spec.agents import uses_agent_pool
from contract.agents import AgentEndpoint, AgentOutcome, AgentPool, EpisodeRecord, EpisodeTicket
from contract.messages import EpisodeSummary, GroupRequest, GroupResult

__all__ = ["AgentEpisodeRunner", "check_agent_parts", "episode_row"]


def episode_row(example: Example) -> dict:
    """What an episode's agent gets as ``row``: every column of its data row, ``prompt`` as the data gave it and
    ``reference``."""
    return {**dict(example.columns), "prompt": example.prompt_as_given, "reference": example.reference}


def check_agent_parts(spec, pool: AgentPool | None, endpoint: AgentEndpoint | None, dry_run: bool) -> bool:
    """Whether the job runs its episodes on the agent pool (``rollout.agent``, or ``rollout.multi_turn.runner:
    agent_pool``).

    Raises:
        SetupError: it does, without an agent pool or an endpoint (and is not a dry run).
    """
    agents = uses_agent_pool(spec.rollout)
    if agents and not dry_run and (pool is None or endpoint is None):
        raise SetupError("rollout.agent: a job with an agent needs an agent pool and the rollout side's endpoint "
                         "(contract.agents); build a ready job with cluster.ray_shell.runtime.build_job(spec) or "
                         "cluster.in_process.local_job(spec)")
    return agents


def _infra(detail: str) -> AgentOutcome:
    return AgentOutcome(None, failure="infra", detail=detail, ended="infra_failed")


class AgentEpisodeRunner:
    """Runs agent episodes for the producer and the held-out evaluation (module docstring).

    Args:
        spec: the job spec (``rollout.agent`` or ``rollout.multi_turn``, ``rollout.agent_pool``,
            ``rollout.group_size``, ``rollout.timeout_s``).
        endpoint: the rollout side's chat-completions endpoint (``contract.agents.AgentEndpoint``), started.
        pool: the agent pool (``contract.agents.AgentPool``), started by the job.
        decode: token ids → text (special tokens skipped), for the rows' texts.
        current_version: the trainer's policy version now (a placeholder row's version).
        status: one-line messages for the log.
        sequences: a record's training sequences (:func:`cluster.loop.agent_sequences.agent_sequences`).
    """

    def __init__(self, spec, endpoint: AgentEndpoint, pool: AgentPool, decode: Callable[[list[int]], str],
                 current_version: Callable[[], int], status: Callable[[str], None] = lambda m: None,
                 sequences: Callable[[EpisodeRecord], list[AgentSequence]] = agent_sequences):
        rollout = spec.rollout
        self.endpoint = endpoint
        self.pool = pool
        self.decode = decode
        self.current_version = current_version
        self._status, self.sequences = status, sequences
        self.group_size, self.timeout_s = rollout.group_size, rollout.timeout_s
        self.multi_turn = rollout.multi_turn  # the environment kind's budget is counted after the prompt
        self.max_episode_tokens = rollout.agent_pool.max_episode_tokens
        self._keys = itertools.count()

    @classmethod
    def for_job(cls, spec, endpoint: AgentEndpoint, pool: AgentPool, tokenizer, versions,
                status: Callable[[str], None]) -> AgentEpisodeRunner:
        """The job's runner: texts decoded with ``tokenizer`` (special tokens skipped), placeholder rows at the
        ``versions`` ledger's current version."""
        return cls(spec, endpoint, pool, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                   lambda: versions.current, status)

    def shutdown(self) -> None:
        """Nothing of its own to stop (the job stops the pool and the endpoint)."""

    def budget(self, request: GroupRequest) -> int:
        """The token budget an episode of ``request`` is opened with: prompt + completion of any of its calls."""
        if self.multi_turn is not None:
            return len(request.prompt_ids) + self.multi_turn.max_episode_tokens
        return self.max_episode_tokens

    def run(self, fleet, requests: list[GroupRequest], examples: Sequence[Example | str], *,
            on_groups: Callable[[list[GroupResult]], None] | None = None, record: bool = True,
            recover: bool = True, interrupt_epoch: int | None = None, carried=None) -> list[GroupResult]:
        """Run every request's G episodes to their end; one :class:`GroupResult` per request, in order, each also
        given to ``on_groups`` the moment its episodes have ended. ``fleet``, ``record``, ``recover``,
        ``interrupt_epoch`` and ``carried`` are the lock-step runner's (``cluster.loop.episodes``), unused: the
        endpoint serves the calls, and agents' requests are continued across a weight sync by the engines.

        Raises:
            the endpoint's errors from ``open_episode`` (episodes opened before are closed).
        """
        examples = [as_example(ex) for ex in examples]
        done: queue.Queue = queue.Queue()
        opened: dict[str, tuple[int, int]] = {}  # episode key -> (request position, episode index)
        try:
            for k, (q, example) in enumerate(zip(requests, examples)):
                for i in range(q.group_size or self.group_size):
                    key, url = self._open(q, i)
                    opened[key] = (k, i)
                    future = self.pool.submit(EpisodeTicket(key, url, episode_row(example)))
                    future.add_done_callback(lambda f, key=key: done.put((key, f)))
        except BaseException:
            for key in opened:
                self._close(key)
            raise
        return self._collect(requests, opened, done, on_groups)

    def _open(self, q: GroupRequest, i: int) -> tuple[str, str]:
        """Open episode ``i`` of ``q`` on the endpoint: (its key, its base URL). Held-out requests
        (``q.sampling``) are sampled at their own temperature."""
        key = f"ep{next(self._keys)}-g{q.group_id}-s{i}"
        held_out = {} if q.sampling is None else {"temperature": q.sampling.temperature}
        url = self.endpoint.open_episode(key, seed=None if q.seed is None else q.seed + i,
                                         max_episode_tokens=self.budget(q), group_id=q.group_id, sample=i, **held_out)
        return key, url

    def _close(self, key: str) -> EpisodeRecord:
        try:
            return self.endpoint.close_episode(key)
        except Exception as exc:  # noqa: BLE001 - an episode the endpoint lost: nothing recorded
            return EpisodeRecord(key, refused=[f"the endpoint could not close it: {type(exc).__name__}: {exc}"])

    def _collect(self, requests: list[GroupRequest], opened: dict[str, tuple[int, int]], done: queue.Queue,
                 on_groups: Callable[[list[GroupResult]], None] | None) -> list[GroupResult]:
        """Wait for every episode (at most ``rollout.timeout_s``); form each group as its last episode ends."""
        ended: list[dict[int, tuple[AgentOutcome, EpisodeRecord]]] = [{} for _ in requests]
        groups: list[GroupResult | None] = [None] * len(requests)
        finals: list[tuple[AgentOutcome, EpisodeRecord]] = []
        deadline = time.monotonic() + self.timeout_s
        waiting = dict(opened)
        try:
            while waiting:
                try:
                    key, future = done.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if key not in waiting:
                    continue
                k, i = waiting.pop(key)
                ended[k][i] = (_result(future), self._close(key))
                if len(ended[k]) == (requests[k].group_size or self.group_size):
                    groups[k] = self._group(requests[k], ended[k], finals)
                    if on_groups is not None:
                        on_groups([groups[k]])
        except BaseException:  # the scorer's error (on_groups): the episodes still running end at the endpoint
            for key in waiting:
                self._close(key)
            raise
        for key, (k, i) in waiting.items():  # past rollout.timeout_s: their workers' own timeouts end them later
            ended[k][i] = (_infra(f"did not end within rollout.timeout_s = {self.timeout_s:g} s"), self._close(key))
        for k, q in enumerate(requests):
            if groups[k] is None:
                groups[k] = self._group(q, ended[k], finals)
                if on_groups is not None:
                    on_groups([groups[k]])
        self._report(finals)
        return groups

    # ---- a group from its episodes --------------------------------------------------------------------------------
    def _group(self, q: GroupRequest, ended: dict[int, tuple[AgentOutcome, EpisodeRecord]],
               finals: list[tuple[AgentOutcome, EpisodeRecord]]) -> GroupResult:
        """The :class:`GroupResult` of one request's G episodes (module docstring); each episode's final outcome is
        appended to ``finals``."""
        rows: list[tuple[int, AgentSequence, EpisodeSummary]] = []
        for i in sorted(ended):
            outcome, record = ended[i]
            outcome = _checked(outcome, record)
            try:
                sequences = self.sequences(record) if outcome.failure != "infra" else []
            except AgentRecordError as exc:  # the endpoint's bug: nothing of the episode can be trained
                outcome, sequences = _infra(f"its record cannot be trained: {exc}"), []
            if not sequences:
                if outcome.failure != "infra":
                    outcome = _infra("the agent made no model call: nothing to train")
                sequences = [self._placeholder(q)]
            finals.append((outcome, record))
            summary = _summary(outcome, record, sequences)
            rows += [(i, s, summary) for s in sequences]
        ordered = [s for _, s, _ in rows]
        sampled_versions = [v for s in ordered for v, m in zip(s.token_versions, s.loss_mask) if m]
        oldest = min(sampled_versions, default=self.current_version())
        return GroupResult(
            q.group_id, list(q.prompt_ids), [list(s.response_ids) for s in ordered],
            [torch.tensor(s.logprobs, dtype=torch.float32) for s in ordered],
            [s.finish_reason for s in ordered], [self.decode(s.response_ids) for s in ordered], oldest,
            token_versions=[list(s.token_versions) for s in ordered], loss_masks=[list(s.loss_mask) for s in ordered],
            episodes=[summary for _, _, summary in rows], episode_of=[i for i, _, _ in rows],
            prompts=[list(s.prompt_ids) for s in ordered])

    def _placeholder(self, q: GroupRequest) -> AgentSequence:
        """One masked token after the group's prompt: the row of an episode with nothing to train."""
        version = self.current_version()
        return AgentSequence(list(q.prompt_ids), [q.prompt_ids[-1]], [False], [0.0], [version])

    def _report(self, finals: list[tuple[AgentOutcome, EpisodeRecord]]) -> None:
        """One line per distinct failure reason and per distinct refused call of this run."""
        failures: Counter = Counter()
        refusals: Counter = Counter()
        for outcome, record in finals:
            if outcome.failure:
                failures[(outcome.failure, outcome.detail)] += 1
            refusals.update(record.refused)
        for (failure, detail), n in failures.most_common(5):
            what = ("infrastructure failure(s): no reward, counted in reward/infra_failed" if failure == "infra"
                    else "policy failure(s): trained with reward 0")
            self._status(f"agent: {n} episode(s) ended as {what}: {detail}")
        for reason, n in refusals.most_common(3):
            self._status(f"agent: the endpoint refused {n} call(s): {reason}")


def _result(future: Future) -> AgentOutcome:
    """The pool's outcome (its futures never raise; a bug of the pool is still one episode's failure)."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - the contract says it never raises; if it does, the episode failed
        return _infra(f"the agent pool failed the episode: {type(exc).__name__}: {exc}")


def _checked(outcome: AgentOutcome, record: EpisodeRecord) -> AgentOutcome:
    """``outcome``, or an infrastructure failure when an engine aborted one of the episode's calls (its tokens are
    incomplete)."""
    if outcome.failure != "infra" and any(c.finish_reason == "abort" for c in record.calls):
        return _infra("an engine aborted one of its calls (finish_reason 'abort')")
    return outcome


def _summary(outcome: AgentOutcome, record: EpisodeRecord, sequences: list[AgentSequence]) -> EpisodeSummary:
    """The episode's :class:`EpisodeSummary` (``turn_reward``: its reward, NaN for none; ``tool_errors`` None unless
    the agent kind reports them: a function agent runs its own tools, and the loop never sees their results)."""
    failed = outcome.failure == "infra"
    ended = "infra_failed" if failed else outcome.ended or ("token_budget" if outcome.failure == "policy" else "done")
    reward = outcome.reward if outcome.reward is not None and not failed else math.nan
    figures = outcome.figures
    tool_calls = int(figures["tool_calls"]) if "tool_calls" in figures else sum(c.tool_calls for c in record.calls)
    tool_errors = int(figures["tool_errors"]) if "tool_errors" in figures else None  # unseen: the agent's own tools
    return EpisodeSummary(
        turns=len(record.calls), tool_calls=tool_calls, tool_errors=tool_errors,
        observation_tokens=sum(not m for s in sequences for m in s.loss_mask if s.calls), ended=ended,
        turn_reward=float(reward), environment_s=float(figures.get("environment_s", 0.0)),
        detail=outcome.detail if failed else "", calls=len(record.calls), sequences=max(len(sequences), 1),
        components=dict(outcome.components) if not failed else {})
