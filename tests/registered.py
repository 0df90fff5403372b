"""Test variants (reward functions, advantage estimators, train backends, ...) registered for one test only."""

from __future__ import annotations

from contextlib import contextmanager


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


@contextmanager
def variant_registered(registry, name: str, register):
    """Register the variant ``name`` with ``register()`` (the project's own ``register_*`` call, so the test goes the
    user's way), yield ``name``, and remove it from ``registry`` (the dict ``register`` adds to) afterwards; also
    from ``train_workers.registry.MODEL_PARALLEL_BACKENDS`` (a no-op for other registries)."""
    from train_workers.registry import MODEL_PARALLEL_BACKENDS

    assert name not in registry, f"{name!r} is registered already: pick a name no test or builtin uses"
    register()
    try:
        yield name
    finally:
        registry.pop(name, None)
        MODEL_PARALLEL_BACKENDS.discard(name)


def parity_reward(completions: list[str], references: list[str]) -> list[float]:
    """The test reward ``parity``: 1.0 for a completion with an even number of characters, else 0.0 (a random tiny
    model never solves GSM8K; parity gives its groups unequal rewards, so a learning signal). Registered by
    ``tests/parity_reward.py`` on import (submitted jobs), or for a module with :func:`temporarily_registered`."""
    return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]
