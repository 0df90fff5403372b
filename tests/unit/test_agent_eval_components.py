"""Held-out agent episodes report the mean of each reward component their agent returned (``eval/reward/<name>``,
as training reports ``reward/<name>``): the coding agent's first-try rate and attempts, the calculator agent's tool
use. An episode that failed (no reward) is left out of the means and of ``eval/accuracy``, and counted in
``eval/unscored``."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.loop.evaluation import agent_scores, eval_metrics
from contract.messages import EpisodeSummary, GroupResult


def group(gid: int, summaries: list[EpisodeSummary]) -> GroupResult:
    n = len(summaries)
    return GroupResult(gid, [1, 2], [[5, 6]] * n, [torch.zeros(2)] * n, ["stop"] * n, ["x"] * n, 0,
                       episodes=summaries)


def test_agent_eval_reports_the_mean_of_each_component():
    ok = EpisodeSummary(turns=1, turn_reward=1.5, calls=1, components={"accuracy": 1.0, "first_try": 1.0,
                                                                          "attempts": 1.0})
    fixed = EpisodeSummary(turns=2, turn_reward=1.0, calls=2, components={"accuracy": 1.0, "first_try": 0.0,
                                                                             "attempts": 2.0})
    failed = EpisodeSummary(turns=1, ended="infra_failed", turn_reward=math.nan, calls=1)
    groups = [group(0, [ok]), group(1, [fixed]), group(2, [failed])]
    metrics = eval_metrics(groups, agent_scores(groups))
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/unscored"] == 1  # the failed episode: not a wrong answer
    assert metrics["eval/turns_mean"] == pytest.approx(4 / 3)
    assert metrics["eval/reward/first_try"] == 0.5 and metrics["eval/reward/attempts"] == 1.5
    assert metrics["eval/reward/accuracy"] == 1.0  # over the episodes that returned it
    plain = [group(0, [EpisodeSummary(turns=1, turn_reward=1.0, calls=1)])]
    assert not [k for k in eval_metrics(plain, agent_scores(plain)) if k.startswith("eval/reward/")]


def test_agent_function_episodes_report_no_tool_success_rate_they_cannot_see():
    # a function agent runs its own tools: the loop saw 2 parsed calls but not whether they failed; the rate was 1.0
    unseen = EpisodeSummary(turns=2, turn_reward=1.0, calls=2, tool_calls=2, tool_errors=None)
    groups = [group(0, [unseen])]
    assert math.isnan(eval_metrics(groups, agent_scores(groups))["eval/tool_success_rate"])
    seen = EpisodeSummary(turns=2, turn_reward=1.0, calls=2, tool_calls=4, tool_errors=1)  # an environment kind's
    groups = [group(0, [unseen]), group(1, [seen])]
    assert eval_metrics(groups, agent_scores(groups))["eval/tool_success_rate"] == 0.75
