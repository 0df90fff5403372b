"""The score stage: sampled groups → rewards, EOS and truncation masks, advantages → :class:`RolloutBatch`.

Notation: B groups, G completions each, N = B·G rows. Rewards are per completion, so scoring each engine's groups as
soon as that engine finishes (:class:`RoundScorer`) and joining them in request order gives the same batch as scoring
all groups at once.
"""

from __future__ import annotations

import time

import torch

from cluster.data import Example
from contract.batches import RolloutBatch
from contract.messages import GroupRequest, GroupResult
from grpo.advantages import compute_multi_reward_advantages
from grpo.eos import response_valid_lengths
from grpo.rewards import OVERLONG_PENALTY_KEY, CombinedRewards, combine_rewards, overlong_penalty

#: Key of the DAPO overlong penalty among the reward components (``reward/overlong_penalty``).
OVERLONG = OVERLONG_PENALTY_KEY


def flatten_groups(groups: list[GroupResult], references: list[str]) -> dict:
    """Groups → row-aligned lists over N = B·G sequences (``prompt_ids``, ``response_ids``, ``behaviour_logprobs``,
    ``finish_reasons``, ``texts``, ``references``, ``versions`` (the group's ``policy_version``: its oldest token's),
    ``token_versions`` (N lists of R_i ints)); ``group_ids`` [N] int64 identifies each row's group. ``references``:
    one per group, in ``groups`` order."""
    out = {k: [] for k in ("prompt_ids", "response_ids", "behaviour_logprobs", "finish_reasons", "texts",
                           "references", "versions", "token_versions")}
    gids = []
    for g, ref in zip(groups, references):
        for i, (ids, lps, reason, text) in enumerate(zip(g.response_ids, g.behaviour_logprobs, g.finish_reasons,
                                                         g.texts)):
            out["token_versions"].append(g.versions_of(i))
            out["prompt_ids"].append(g.prompt_ids)
            out["response_ids"].append(ids if ids else [])
            out["behaviour_logprobs"].append(lps)
            out["finish_reasons"].append(reason)
            out["texts"].append(text)
            out["references"].append(ref)
            out["versions"].append(g.policy_version)
            gids.append(g.group_id)
    out["group_ids"] = torch.tensor(gids, dtype=torch.long)
    return out


def join_rewards(scored_groups: list[CombinedRewards]) -> CombinedRewards:
    """Per-group reward results (in row order) → one over all their rows: totals and components concatenated,
    failure counts summed."""
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

    Attributes:
        weights: reward function name → weight in use; starts as ``algorithm.rewards`` (the frozen spec's), changed
            only by the reward-hacking guard's rollback (:mod:`cluster.loop.guard`).
    """

    def __init__(self, algorithm, max_response_tokens: int, eos_ids: frozenset[int]):
        self.algorithm, self.max_response_tokens, self.eos_ids = algorithm, max_response_tokens, eos_ids
        self.weights = dict(algorithm.rewards)

    def rewards(self, texts: list[str], references: list[str]) -> CombinedRewards:
        """The reward functions on N completions (one reference each).

        Raises:
            RuntimeError: a reward function raised and ``algorithm.reward_on_error`` is ``raise``.
        """
        alg = self.algorithm
        return combine_rewards(texts, references, self.weights, on_error=alg.reward_on_error)

    def score(self, groups: list[GroupResult], references: list[str],
              scored_groups: list[CombinedRewards] | None = None) -> RolloutBatch:
        """Score ``groups`` (one reference each, in order) into a batch with rewards, masks and advantages.

        ``scored_groups`` are the groups' reward-function results when they were already computed as the groups
        arrived (one per group, in ``groups`` order); rewards are per completion, so joining them is exact.

        Only the response ids count for EOS (a prompt holding an EOS id terminates nothing); tokens after the first
        EOS are masked; with ``mask_truncated`` a completion without EOS is masked whole but keeps its place (and
        reward) in its group.
        """
        alg = self.algorithm
        rows = flatten_groups(groups, references)
        valid_lengths, terminated = response_valid_lengths(rows["response_ids"], self.eos_ids)
        scored = (self.rewards(rows["texts"], rows["references"]) if scored_groups is None
                  else join_rewards(scored_groups))
        per_function, weights, total = dict(scored.per_function), dict(self.weights), scored.total
        if alg.overlong_buffer_tokens is not None:
            penalty = overlong_penalty(valid_lengths, self.max_response_tokens, alg.overlong_buffer_tokens,
                                       alg.overlong_penalty_factor)
            per_function[OVERLONG], weights[OVERLONG], total = penalty, 1.0, total + penalty
        advantages = compute_multi_reward_advantages(
            per_function, weights, rows["group_ids"], alg.advantage_estimator, combine=alg.reward_combine,
            eps=alg.adv_eps, std=alg.adv_std)
        if alg.mask_truncated:
            valid_lengths = [v if t else 0 for v, t in zip(valid_lengths, terminated)]
        return RolloutBatch(**rows, valid_lengths=valid_lengths, terminated=terminated, rewards=total,
                            per_function=per_function, advantages=advantages,
                            num_failed=sum(scored.num_failed.values()))


class RoundScorer:
    """Scores one sampling round: each engine's groups as soon as that engine finishes (:meth:`on_groups`, the
    rollout pool's callback), while the others still sample; then the whole round (:meth:`batch`).

    Args:
        scoring: the job's :class:`Scoring`.
        requests, examples: the round's requests and their examples (same order).

    Attributes:
        seconds: wall seconds spent in :meth:`on_groups` (reward functions run as groups arrive).
    """

    def __init__(self, scoring: Scoring, requests: list[GroupRequest], examples: list[Example]):
        self.scoring = scoring
        self.references = [ex.reference for ex in examples]
        self._by_group = {q.group_id: ex.reference for q, ex in zip(requests, examples)}
        self._early: dict[int, CombinedRewards] = {}
        self.seconds = 0.0

    def on_groups(self, results: list[GroupResult]) -> None:
        """Compute the reward functions of one finished engine's groups (complete ones only: a group with an
        interrupted completion, partial rollouts, is scored once it is continued)."""
        t = time.perf_counter()
        for g in results:
            if not g.complete:
                continue
            self._early[g.group_id] = self.scoring.rewards(g.texts, [self._by_group[g.group_id]] * len(g.texts))
        self.seconds += time.perf_counter() - t

    def batch(self, groups: list[GroupResult]) -> RolloutBatch:
        """The round's batch; ``groups`` in request order, every one seen by :meth:`on_groups`."""
        return self.scoring.score(groups, self.references, [self._early[g.group_id] for g in groups])
