"""Test reward functions registered for one test module only."""

from __future__ import annotations


def temporarily_registered(name: str, reward):
    """Fixture body: register the test reward function ``reward`` as ``name`` unless that name exists, yield the
    name, and remove it again afterwards if it was added here."""
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    added = name not in REWARD_FUNCTIONS
    if added:
        register_reward_function(name)(reward)
    yield name
    if added:
        REWARD_FUNCTIONS.pop(name)
