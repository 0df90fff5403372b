"""Rewards of the own-task example (examples/own_task/spec.yaml): whole-row functions that read the data's columns.

The spec names them by file: ``algorithm.rewards: {"reward.py:correct": 1.0, "reward.py:within_budget": 0.2}``.
Each is called with the completions and, as keywords, the columns of their rows it names (one value per completion).
"""

import re

from grpo.rewards.final_answer import commits_to_number
from grpo.rewards.numbers import first_number

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def correct(completions, answer):
    """1.0 when the completion commits to one final answer equal to the row's ``answer`` column, else 0.0.

    The final answer is what ``grpo.rewards.final_answer`` reads (a ``####`` line, a ``\\boxed{}``, "the answer is
    ...", else the last number), and the completion must commit to it: a hedge — "it is 12 or maybe 15", a list or a
    range of values, two different answers — scores 0.0 even when one of its values is right (docs/own_task.md, "One
    committed final answer").
    """
    return [1.0 if commits_to_number(completion, first_number(str(expected))) else 0.0
            for completion, expected in zip(completions, answer)]


def _check_answer(answer):
    """Checked for every row when the data is loaded: ``answer`` must be a number."""
    if _NUMBER.fullmatch(str(answer).strip()) is None:
        raise ValueError(f"expected the answer column to be a number, got {answer!r}")


correct.check_row = _check_answer


def within_budget(prompts, completions, difficulty):
    """1.0 for a reply of at most 60 characters per level of the row's ``difficulty`` column, else 0.0: harder
    problems may take more words. ``prompts`` (unused here) holds each row's prompt as the data gave it."""
    return [1.0 if len(c) <= 60 * int(d) else 0.0 for c, d in zip(completions, difficulty)]
