"""Importing this module registers the test reward ``parity`` (1.0 when the completion text has an even number of
characters, else 0.0): a random tiny model never solves GSM8K, parity gives it groups with unequal rewards.

Submitted jobs load it with ``grpo-cluster submit ... --import tests.parity_reward``.
"""

from __future__ import annotations

from grpo.rewards import REWARD_FUNCTIONS, register_reward_function


def parity_reward(completions: list[str], references: list[str]) -> list[float]:
    """1.0 for a completion with an even number of characters, else 0.0."""
    return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]


if "parity" not in REWARD_FUNCTIONS:
    register_reward_function("parity")(parity_reward)
