"""Importing this module registers the test reward ``parity`` (1.0 when the completion text has an even number of
characters, else 0.0): a random tiny model never solves GSM8K, parity gives it groups with unequal rewards.

Submitted jobs load it with ``grpo-cluster submit ... --import tests.parity_reward``.
"""

from __future__ import annotations

from grpo.rewards import REWARD_FUNCTIONS, register_reward_function
from tests.registered import parity_reward


if "parity" not in REWARD_FUNCTIONS:
    register_reward_function("parity")(parity_reward)
