"""The score stage: sampled groups → rewards, EOS and truncation masks, advantages → :class:`RolloutBatch`.

Notation: B groups, G completions each, N = B·G rows. Rewards are per completion, so scoring each engine's groups as
soon as that engine finishes (:class:`RoundScorer`) and joining them in request order gives the same batch as scoring
all groups at once. Reward functions see each completion's whole row (``grpo.rewards.combine_rewards``: its prompt as
given and every column of its :class:`cluster.data.Example`). They run in the job's reward pool
(``contract.protocols.RewardPool``): in the driver as the groups arrive (the default), or on reward workers, to which
each engine's groups are submitted as they arrive and whose scores the round collects before its advantages.

A reward function's None means "does not apply to this row" (TRL's convention): the row's total is the weighted sum
of the functions that scored it, its advantage is computed from that total (``normalise-then-sum``: each function
over the rows it scored), and it is counted in ``reward/not_applicable``.

Infrastructure failures are not policy failures. A completion without a reward (no weighted function scored it, one
raised with ``algorithm.reward_on_error: none``, or it timed out in a reward pool) has total reward NaN: it is left out
of its
group's mean and std (``grpo.advantages``: advantage 0), out of the loss (``valid_lengths`` 0: none of its tokens
count, nor does it count as a sequence) and out of the step's reward, length and group metrics
(``cluster.loop.step_metrics``), which therefore equal those of the same round without it; it is counted in
``reward/infra_failed``. A round where more than ``algorithm.max_infra_failed_fraction`` of the completions (or all of
them) have none raises :class:`InfraFailureError` before anything is trained.

Multi-turn episodes (``rollout.multi_turn``, ``cluster.loop.episodes``) are scored as completions whose response is
the whole episode: the reward functions see its decoded text; its turn rewards are one more component,
``environment`` (weight 1), NaN when its environment failed (an infrastructure failure as above), added to the reward
functions' total (so an episode no reward function scored has none, whatever its turn rewards); only its last turn
is searched for the EOS that terminates it (``grpo.eos.response_valid_lengths``), and its observation tokens never
count in the loss (``RolloutBatch.loss_masks``).

Agents (``rollout.agent``, ``cluster.loop.agent_episodes``) return their episode's reward: it is the component
``agent`` (weight 1; NaN when the agent returned None or failed: an infrastructure failure as above), and with an
agent ``algorithm.rewards`` is empty. An episode whose agent rewrote its history is several rows (sequences) with one
``RolloutBatch.episode_ids`` entry: its rows share the reward of its last row, and advantages are computed over the G
episodes of each group (one row each), then given to every row of the episode (verl's and SkyRL's rule for a
trajectory split into several sequences); the infrastructure-failure limit counts episodes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from cluster.data import Example, as_example, row_columns
from cluster.rewards.inline import InlineRewardPool
from cluster.spec.multi_turn import ENVIRONMENT_REWARD
from contract.batches import RolloutBatch
from contract.messages import EpisodeSummary, GroupRequest, GroupResult
from contract.protocols import RewardPool
from contract.rewards import RewardCall, RewardTicket
from grpo.advantages import compute_multi_reward_advantages
from grpo.eos import response_valid_lengths
from grpo.rewards import (OVERLONG_PENALTY_KEY, CombinedRewards, combine_rewards, count_not_applicable,
                          overlong_penalty)

#: Key of the DAPO overlong penalty among the reward components (``reward/overlong_penalty``).
OVERLONG = OVERLONG_PENALTY_KEY


class InfraFailureError(RuntimeError):
    """Too many completions of a sampling round got no reward (``algorithm.max_infra_failed_fraction``); the
    message names the field, the counts and the functions that gave none."""


def check_infra_failures(total: torch.Tensor, per_function: dict[str, torch.Tensor], weights: dict[str, float],
                         limit: float) -> int:
    """The number of completions without a reward (NaN ``total``); raises when there are too many.

    Args:
        total: [N] float32 total rewards. per_function: name → [N] unweighted rewards.
        weights: name → weight in use.
        limit: ``algorithm.max_infra_failed_fraction``.

    Raises:
        InfraFailureError: the failed fraction exceeds ``limit``, or every completion failed (nothing to train on).
    """
    n, failed = total.numel(), int(total.isnan().sum())
    if not failed or (failed < n and failed / n <= limit):
        return failed
    failed_rows = total.isnan()
    by_function = ", ".join(f"{name} {int((values.isnan() & failed_rows).sum())}"
                            for name, values in per_function.items()
                            if weights.get(name, 0.0) != 0.0 and (values.isnan() & failed_rows).any())
    what = "every completion" if failed == n else f"{failed} of {n} completions ({failed / n:.1%})"
    raise InfraFailureError(
        f"algorithm.max_infra_failed_fraction: {what} of this sampling round got no reward (no score from "
        f"{by_function or 'the reward functions'}: None from every weighted reward function, a raise with "
        f"algorithm.reward_on_error 'none', or a timeout), "
        f"over the allowed {limit:g}. These are infrastructure failures (the verifier could not run), not the "
        f"policy's: fix the reward function or its service, or raise algorithm.max_infra_failed_fraction")


#: Episode ids of a step's rows are ``group_id * EPISODE_ID_STRIDE + episode index`` (G <= 1024 < the stride).
EPISODE_ID_STRIDE = 1 << 16


def flatten_groups(groups: list[GroupResult], references: list[str]) -> dict:
    """Groups → row-aligned lists over N = B·G sequences (``prompt_ids``, ``response_ids``, ``behaviour_logprobs``,
    ``finish_reasons``, ``texts``, ``references``, ``versions`` (the group's ``policy_version``: its oldest token's),
    ``token_versions`` (N lists of R_i ints)); ``group_ids`` [N] int64 identifies each row's group. ``references``:
    one per group, in ``groups`` order. Multi-turn episodes add ``loss_masks`` (N lists of R_i bools) and
    ``episodes`` (N summaries); both are None when no group has them. Agents' groups add ``episode_ids`` ([N] int64,
    :data:`EPISODE_ID_STRIDE`), None when no group has ``episode_of``; their rows' prompts are their own
    (``GroupResult.prompt_of``)."""
    out = {k: [] for k in ("prompt_ids", "response_ids", "behaviour_logprobs", "finish_reasons", "texts",
                           "references", "versions", "token_versions", "loss_masks", "episodes")}
    gids, episode_ids = [], []
    for g, ref in zip(groups, references):
        for i, (ids, lps, reason, text) in enumerate(zip(g.response_ids, g.behaviour_logprobs, g.finish_reasons,
                                                         g.texts)):
            out["token_versions"].append(g.versions_of(i))
            out["loss_masks"].append(g.sampled_of(i))
            out["episodes"].append(g.episodes[i] if g.episodes is not None else None)
            out["prompt_ids"].append(g.prompt_of(i))
            episode_ids.append(g.group_id * EPISODE_ID_STRIDE + g.episode_index(i))
            out["response_ids"].append(ids if ids else [])
            out["behaviour_logprobs"].append(lps)
            out["finish_reasons"].append(reason)
            out["texts"].append(text)
            out["references"].append(ref)
            out["versions"].append(g.policy_version)
            gids.append(g.group_id)
    out["group_ids"] = torch.tensor(gids, dtype=torch.long)
    out["episode_ids"] = (None if all(g.episode_of is None for g in groups)
                          else torch.tensor(episode_ids, dtype=torch.long))
    if all(g.loss_masks is None for g in groups):
        out["loss_masks"] = None
    if all(g.episodes is None for g in groups):
        out["episodes"] = None
    return out


def environment_rewards(episodes: list[EpisodeSummary]) -> torch.Tensor:
    """[N] float32: each episode's turn rewards summed, NaN for an episode whose environment failed (no reward:
    left out of its group's statistics and of the loss, counted in ``reward/infra_failed``)."""
    return torch.tensor([float("nan") if e.infra_failed else e.turn_reward for e in episodes], dtype=torch.float32)


def episode_representatives(episode_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, inverse) for rows grouped by episode: ``rows`` [E] int64, the last row of each of the E episodes in row
    order; ``inverse`` [N] int64, the position in ``rows`` of each row's episode, so ``x[rows][inverse]`` gives every
    row its episode's value."""
    last: dict[int, int] = {}
    for i, episode in enumerate(episode_ids.tolist()):
        last[episode] = i
    order = sorted(last.values())
    position = {episode_ids[i].item(): k for k, i in enumerate(order)}
    inverse = torch.tensor([position[e] for e in episode_ids.tolist()], dtype=torch.long)
    return torch.tensor(order, dtype=torch.long), inverse


def no_rewards(n: int) -> CombinedRewards:
    """The reward functions' result when there are none (an agent's job: its return is the reward): zeros, no
    component."""
    return CombinedRewards(torch.zeros(n, dtype=torch.float32), {}, {})


def join_rewards(scored_groups: list[CombinedRewards]) -> CombinedRewards:
    """Per-group reward results (in row order) → one over all their rows: totals and components concatenated,
    failure counts summed."""
    if not scored_groups:
        return no_rewards(0)
    return CombinedRewards(
        torch.cat([c.total for c in scored_groups]),
        {k: torch.cat([c.per_function[k] for c in scored_groups]) for k in scored_groups[0].per_function},
        {k: sum(c.num_failed[k] for c in scored_groups) for k in scored_groups[0].num_failed})


class Scoring:
    """Rewards (weighted functions + DAPO overlong penalty), EOS and truncation masks, and advantages.

    Args:
        algorithm: the spec's ``algorithm`` section (reward weights and combination, estimator, masking, penalty).
        max_response_tokens: ``rollout.max_response_tokens`` (L_max of the overlong penalty).
        eos_ids: every EOS id of the model (:func:`cluster.loop.setup.model_eos_ids`).
        episode_reward: the component name of an episode's own reward (``EpisodeSummary.turn_reward``): ``environment``
            (multi-turn environments' turn rewards) or ``agent`` (an agent's return).

    Attributes:
        weights: reward function name → weight in use; starts as ``algorithm.rewards`` (the frozen spec's), changed
            only by the reward-hacking guard's rollback (:mod:`cluster.loop.guard`).
    """

    def __init__(self, algorithm, max_response_tokens: int, eos_ids: frozenset[int],
                 episode_reward: str = ENVIRONMENT_REWARD):
        self.algorithm, self.max_response_tokens, self.eos_ids = algorithm, max_response_tokens, eos_ids
        self.episode_reward = episode_reward
        self.weights = dict(algorithm.rewards)

    def rewards(self, texts: list[str], rows: Sequence[Example | str]) -> CombinedRewards:
        """The reward functions on N completions, one row each (its Example: prompt, columns and reference; a bare
        reference string stands for a row with nothing else), run here.

        Raises:
            RewardError: a reward function raised and ``algorithm.reward_on_error`` is ``raise``, or broke its
                contract (wrong count, non-numbers).
        """
        if not self.weights:
            return no_rewards(len(texts))
        call = self.call(texts, rows)
        return combine_rewards(call.completions, call.references, call.weights, on_error=call.on_error,
                               prompts=call.prompts, columns=call.columns)

    def call(self, texts: list[str], rows: Sequence[Example | str]) -> RewardCall:
        """The reward call for N completions, one row each (as :meth:`rewards`), with the weights in use now."""
        rows = [as_example(r) for r in rows]
        return RewardCall(list(texts), [r.reference for r in rows], [r.prompt_as_given for r in rows],
                          row_columns(rows), dict(self.weights), self.algorithm.reward_on_error)

    def score(self, groups: list[GroupResult], rows: Sequence[Example | str],
              scored_groups: list[CombinedRewards] | None = None) -> RolloutBatch:
        """Score ``groups`` (one row each, in order: its Example, or a bare reference string) into a batch with
        rewards, masks and advantages.

        ``scored_groups`` are the groups' reward-function results when they were already computed as the groups
        arrived (one per group, in ``groups`` order); rewards are per completion, so joining them is exact.

        Only the response ids count for EOS (a prompt holding an EOS id terminates nothing); tokens after the first EOS
        are masked; with ``mask_truncated`` a completion that neither holds an EOS nor ended at a stop string
        (``rollout.stop``) is masked whole but keeps its place (and reward) in its group. A completion without a reward
        (NaN total) is masked whole and has advantage 0 (module docstring).

        Raises:
            InfraFailureError: too many completions without a reward (``algorithm.max_infra_failed_fraction``).
        """
        alg = self.algorithm
        examples = [as_example(r) for r in rows]
        rows = flatten_groups(groups, [ex.reference for ex in examples])
        valid_lengths, terminated = response_valid_lengths(rows["response_ids"], self.eos_ids, rows["loss_masks"],
                                                           [r == "stop" for r in rows["finish_reasons"]])
        per_row = [ex for g, ex in zip(groups, examples) for _ in g.texts]
        scored = self.rewards(rows["texts"], per_row) if scored_groups is None else join_rewards(scored_groups)
        per_function, weights, total = dict(scored.per_function), dict(self.weights), scored.total
        if alg.overlong_buffer_tokens is not None:
            penalty = overlong_penalty(valid_lengths, self.max_response_tokens, alg.overlong_buffer_tokens,
                                       alg.overlong_penalty_factor)
            per_function[OVERLONG], weights[OVERLONG], total = penalty, 1.0, total + penalty
        if rows["episodes"] is not None:  # multi-turn: turn rewards, and environment failures as missing rewards
            env = environment_rewards(rows["episodes"])
            name = self.episode_reward
            per_function[name], weights[name], total = env, 1.0, total + env
        group_ids = rows["group_ids"]
        if rows["episode_ids"] is not None:  # agents: one reward and one advantage per episode (module docstring)
            reps, inverse = episode_representatives(rows["episode_ids"])
            total, group_ids = total[reps], group_ids[reps]
            per_function = {k: v[reps] for k, v in per_function.items()}
        check_infra_failures(total, per_function, weights, alg.max_infra_failed_fraction)
        advantages = compute_multi_reward_advantages(
            per_function, weights, group_ids, alg.advantage_estimator, combine=alg.reward_combine,
            eps=alg.adv_eps, std=alg.adv_std, valid=~total.isnan())
        if rows["episode_ids"] is not None:
            total, advantages = total[inverse], advantages[inverse]
            per_function = {k: v[inverse] for k, v in per_function.items()}
        failed = total.isnan().tolist()
        valid_lengths = [0 if f or (alg.mask_truncated and not t) else v
                         for v, t, f in zip(valid_lengths, terminated, failed)]
        return RolloutBatch(**rows, valid_lengths=valid_lengths, terminated=terminated, rewards=total,
                            per_function=per_function, advantages=advantages,
                            num_failed=sum(scored.num_failed.values()),
                            num_not_applicable=count_not_applicable(total, scored.per_function, self.weights))


class RoundScorer:
    """Scores one sampling round: each engine's groups are submitted to the reward pool as soon as that engine
    finishes (:meth:`on_groups`, the rollout pool's callback), while the others still sample; then the round's scores
    are collected and the batch made (:meth:`batch`).

    Args:
        scoring: the job's :class:`Scoring`.
        requests, examples: the round's requests and their examples (same order).
        pool: where the reward functions run (``contract.protocols.RewardPool``); None: in this thread
            (:class:`cluster.rewards.inline.InlineRewardPool`).
        collect_timeout_s: the longest :meth:`batch` waits for the pool's scores (the loop passes
            ``rollout.timeout_s``); what is not scored by then gets no reward.
        driver_clock: the driver's :class:`cluster.loop.goodput.DriverClock`: :meth:`on_groups` is the driver's own
            work (even inside the engines' generate call), collecting the scores a wait on the reward pool; None: not
            counted.

    Attributes:
        seconds: wall seconds spent in :meth:`on_groups` (with an inline pool: the reward functions themselves).
    """

    def __init__(self, scoring: Scoring, requests: list[GroupRequest], examples: list[Example],
                 pool: RewardPool | None = None, collect_timeout_s: float = 900.0, driver_clock=None):
        self.scoring, self.collect_timeout_s = scoring, collect_timeout_s
        self._working = driver_clock.working if driver_clock is not None else contextlib.nullcontext
        self._waiting = driver_clock.waiting if driver_clock is not None else contextlib.nullcontext
        self.pool = pool if pool is not None else InlineRewardPool()
        self.examples = list(examples)
        self._by_group = {q.group_id: ex for q, ex in zip(requests, examples)}
        self._submitted: list[tuple[RewardTicket, list[int]]] = []
        self.seconds = 0.0

    def on_groups(self, results: list[GroupResult]) -> None:
        """Submit the reward calls of one finished engine's groups, one call per group (complete ones only: a group
        with an interrupted completion, partial rollouts, is scored once it is continued)."""
        t = time.perf_counter()
        done = [g for g in results if g.complete]
        if done and self.scoring.weights:  # none: an agent's return is the reward
            with self._working():
                calls = [self.scoring.call(g.texts, [self._by_group[g.group_id]] * len(g.texts)) for g in done]
                self._submitted.append((self.pool.submit(calls), [g.group_id for g in done]))
        self.seconds += time.perf_counter() - t

    def batch(self, groups: list[GroupResult]) -> RolloutBatch:
        """The round's batch; ``groups`` in request order, every one seen by :meth:`on_groups` (a group submitted
        twice, sampled again after an engine fault, keeps its last scores)."""
        scored: dict[int, CombinedRewards] = {}
        deadline = time.monotonic() + self.collect_timeout_s
        for ticket, group_ids in self._submitted:
            remaining = max(deadline - time.monotonic(), 0.0)
            with self._waiting():
                collected = self.pool.collect(ticket, remaining)
            for gid, scores in zip(group_ids, collected):
                scored[gid] = CombinedRewards(*scores)
        self._submitted = []
        return self.scoring.score(groups, self.examples,
                                  [scored.get(g.group_id) or no_rewards(len(g.texts)) for g in groups])
