"""The moves of an ecosystem environment's episode played again on a fresh environment of the same seed: what the
environment itself pays for them, the reference the agent kinds' rewards (``cluster/agents/kinds/``) are checked
against (``tests/in_process/test_agent_ecosystem_*.py``)."""

from __future__ import annotations

from collections.abc import Sequence


def replay_textarena(env_id: str, seed: int, moves: Sequence[str]) -> tuple[float, bool]:
    """(player 0's reward, whether the game ended) after ``moves`` in TextArena game ``env_id`` reset with ``seed``
    (one player); the reward is 0.0 for a game that did not end."""
    import textarena as ta

    env = ta.make(env_id)
    env.reset(num_players=1, seed=seed)
    done = False
    for move in moves:
        env.get_observation()
        done, _ = env.step(move)
    rewards, _ = env.close()
    return (float(rewards[0]) if done and rewards else 0.0), done


def replay_gymnasium(env_id: str, seed: int, moves: Sequence[str]) -> float:
    """The summed reward of ``moves`` in Gymnasium environment ``env_id`` (registered) reset with ``seed``."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.reset(seed=seed)
    return sum(float(env.step(move)[1]) for move in moves)
