"""Scoring held-out completions (``cluster.loop.evaluation``'s ``eval/*`` figures): each completion by the eval's
reward functions, called as in training (``grpo.rewards.combine_rewards``: whole-row functions get the prompts and
every column of the rows), and the figures of one evaluation. A completion the accuracy reward gives no score
(None/NaN: its verifier failed) is unscored, not wrong: it is left out of ``eval/accuracy``, its Wilson interval,
``eval/n`` and ``eval/problems`` and counted in ``eval/unscored`` (the format reward's likewise, in
``eval/format_unscored``); the figures are defined in ``cluster.loop.evaluation``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.data import Example, as_example, row_columns
from cluster.loop.episode_metrics import EVAL_EPISODE_KEYS, component_metrics, episode_metrics
from contract.messages import GroupResult
from grpo.rewards import combine_rewards
from grpo.stats import accuracy_estimate

__all__ = ["EvalScores", "agent_scores", "eval_metrics", "score_eval", "score_problems", "unscored_warning"]


def _scores(name: str, texts: list[str], rows: list[Example]) -> list[float | None]:
    """Reward function ``name`` on the completions, one row (its Example) each, called as in training
    (``grpo.rewards.combine_rewards``); None where it gave no score (None/NaN).

    Raises:
        ValueError: a score outside [0, 1] (eval rates need 1 = pays, 0 = does not), naming the function.
        RewardError: the function raised, or returned the wrong number of values, non-numbers or ±inf.
    """
    result = combine_rewards(texts, [ex.reference for ex in rows], {name: 1.0},
                             prompts=[ex.prompt_as_given for ex in rows], columns=row_columns(rows))
    out: list[float | None] = []
    for value in result.per_function[name].tolist():
        if math.isnan(value):
            out.append(None)
            continue
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"eval: reward function {name!r} gave {value!r}; eval needs scores in [0, 1]")
        out.append(float(value))
    return out


@dataclass(frozen=True)
class EvalScores:
    """The scores behind one evaluation's ``eval/*`` figures.

    Attributes:
        correct: P lists of k outcomes, 1.0 (full credit), 0.0 or None (unscored: the accuracy reward gave no
            score), one list per held-out prompt in order.
        formatted: P·k format scores in [0, 1] or None (unscored) in group order, or None without a format reward.
    """

    correct: list[list[float | None]]
    formatted: list[float | None] | None

    @property
    def scored(self) -> list[list[float]]:
        """The outcomes of the prompts with at least one scored completion, unscored ones left out."""
        kept = [[v for v in outcomes if v is not None] for outcomes in self.correct]
        return [outcomes for outcomes in kept if outcomes]

    @property
    def unscored(self) -> int:
        """Completions the accuracy reward gave no score (``eval/unscored``)."""
        return sum(v is None for outcomes in self.correct for v in outcomes)

    @property
    def format_unscored(self) -> int:
        """Completions the format reward gave no score (``eval/format_unscored``; 0 without one)."""
        return sum(v is None for v in self.formatted or ())


def score_problems(groups: list[GroupResult], rows: list[Example] | list[str], accuracy_reward: str,
                   format_reward: str | None) -> EvalScores:
    """Score P groups of k completions with the eval's reward functions (called once each over the whole set).

    Args:
        groups: P results, one per held-out prompt, each with k completions.
        rows: P held-out rows (their Examples; a bare reference string stands for a row with only a reference).
        accuracy_reward, format_reward: reward function names (``format_reward`` None: no format scores).

    Raises:
        ValueError: a different number of groups and rows, or a score outside [0, 1].
    """
    rows = [as_example(r) for r in rows]
    if len(groups) != len(rows):
        raise ValueError(f"eval: {len(groups)} groups for {len(rows)} held-out rows; expected one group per row")
    texts = [t for g in groups for t in g.texts]
    per_row = [ex for g, ex in zip(groups, rows) for _ in g.texts]
    # correct = full credit: a partial score (reasoning-gym's decimal scorer pays 0.75 for "-191" against 191) is a
    # wrong answer, so pass@1 and its Wilson interval are of 0/1 outcomes; no score stays None (unscored)
    flat = [None if s is None else 1.0 if s >= 1.0 else 0.0 for s in _scores(accuracy_reward, texts, per_row)]
    correct, start = [], 0
    for g in groups:
        correct.append(flat[start:start + len(g.texts)])
        start += len(g.texts)
    formatted = _scores(format_reward, texts, per_row) if format_reward is not None else None
    return EvalScores(correct=correct, formatted=formatted)


def agent_scores(groups: list[GroupResult]) -> EvalScores:
    """An agent's held-out episodes scored by its own reward (``cluster.loop.evaluation``'s docstring): per group,
    one outcome per episode (its last row's summary), 1.0 when its ``accuracy`` component (else its reward) is >= 1,
    None (unscored) when the agent gave no reward (it returned None or failed); no format scores."""
    correct = []
    for g in groups:
        outcomes: list[float | None] = []
        for i in g.episode_rows():
            summary = g.episodes[i]
            value = summary.components.get("accuracy", summary.turn_reward)
            outcomes.append(None if math.isnan(value) else 1.0 if value >= 1.0 else 0.0)
        correct.append(outcomes)
    return EvalScores(correct=correct, formatted=None)


def eval_metrics(groups: list[GroupResult], scores: EvalScores) -> dict[str, float]:
    """The ``eval/*`` figures (module docstring) of P groups and their :func:`score_problems` scores, without
    timing and best-step keys. The accuracy, its interval, ``eval/n`` and ``eval/problems`` count only what the
    accuracy reward scored (``eval/unscored``: the rest); with nothing scored they are NaN, 0 and 0.

    Raises:
        ValueError: no groups.
    """
    if not groups:
        raise ValueError("eval: no groups to score; expected one per held-out prompt")
    scored = scores.scored
    if scored:
        est = accuracy_estimate(scored)
        accuracy = {"eval/accuracy": est.accuracy, "eval/accuracy_ci_low": est.ci_low,
                    "eval/accuracy_ci_high": est.ci_high}
    else:
        accuracy = dict.fromkeys(("eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high"), math.nan)
    lengths = [sum(g.sampled_of(i)) for g in groups for i in range(len(g.response_ids))]  # sampled tokens only
    reasons = [r for g in groups for r in g.finish_reasons]
    metrics = {**accuracy, "eval/n": float(sum(map(len, scored))), "eval/problems": float(len(scored)),
               "eval/unscored": float(scores.unscored),
               "eval/response_length_mean": sum(lengths) / len(lengths),
               "eval/truncated_fraction": sum(r == "length" for r in reasons) / len(reasons)}
    episodes = [g.episodes[i] for g in groups if g.episodes is not None for i in g.episode_rows()]
    if episodes:  # multi-turn: how the held-out episodes went
        full = episode_metrics(episodes, prefix="")
        metrics.update({f"eval/{key}": full[key] for key in EVAL_EPISODE_KEYS})
        metrics.update(component_metrics(episodes, prefix="eval/reward/"))
    if scores.formatted is not None:
        paid = [v for v in scores.formatted if v is not None]
        metrics["eval/format_rate"] = sum(paid) / len(paid) if paid else math.nan
        metrics["eval/format_unscored"] = float(scores.format_unscored)
    return metrics


def unscored_warning(metrics: dict[str, float], reward: str) -> str | None:
    """The warning an evaluation with unscored completions deserves (None when every completion was scored): how
    many, by which ``reward`` (as the message names it: ``eval.accuracy_reward 'accuracy'``), and that they are left
    out of ``eval/accuracy`` rather than counted wrong."""
    unscored = int(metrics.get("eval/unscored", 0))
    if not unscored:
        return None
    total = unscored + int(metrics["eval/n"])
    return (f"eval: {unscored} of {total} held-out completions got no score from {reward} (None: its verifier "
            f"could not run); they are left out of eval/accuracy and its "
            f"interval, which are over the {int(metrics['eval/n'])} scored ({int(metrics['eval/problems'])} "
            f"problems), and counted in eval/unscored")


def score_eval(groups: list[GroupResult], rows: list[Example] | list[str], accuracy_reward: str,
               format_reward: str | None) -> dict[str, float]:
    """The ``eval/*`` figures of P groups of k completions (module docstring), without timing and best-step keys:
    :func:`eval_metrics` of :func:`score_problems`.

    Args:
        groups: P results, one per held-out prompt, each with k completions.
        rows: P held-out rows (their Examples; a bare reference string stands for a row with only a reference).
        accuracy_reward, format_reward: reward function names (``format_reward`` None: no format rate).

    Raises:
        ValueError: no groups, groups of different k, or a score outside [0, 1].
    """
    if not groups:
        raise ValueError("eval: no groups to score; expected one per held-out prompt")
    return eval_metrics(groups, score_problems(groups, rows, accuracy_reward, format_reward))
