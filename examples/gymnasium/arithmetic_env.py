"""A Gymnasium text environment written with the plain Gymnasium API: a drill of one-digit sums, one per step.

The observation and the action are text (``gymnasium.spaces.Text``); each right answer (the reply's last whole
number) earns 1/problems, so an episode's return is the share it got right. Registered on import as
``ArithmeticDrill-v0``; ``spec.yaml`` next to this file trains on it: ``agent: gymnasium:arithmetic_env.py:
ArithmeticDrill-v0`` (docs/agents.md, "Ecosystem environments").
"""

import re
import string

import gymnasium
from gymnasium import spaces

CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"


class ArithmeticDrill(gymnasium.Env):
    metadata = {"render_modes": []}

    def __init__(self, problems: int = 3, largest: int = 9):
        self.problems = problems
        self.largest = largest
        self.observation_space = spaces.Text(max_length=256, charset=CHARACTERS)
        self.action_space = spaces.Text(max_length=256, charset=CHARACTERS)

    def _ask(self) -> str:
        a, b = self.pairs[self.index]
        return f"What is {a} + {b}? Answer with the number."

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        draw = lambda: int(self.np_random.integers(0, self.largest + 1))  # noqa: E731
        self.pairs = [(draw(), draw()) for _ in range(self.problems)]
        self.index = 0
        return self._ask(), {}

    def step(self, action: str):
        a, b = self.pairs[self.index]
        numbers = re.findall(r"-?\d+", action)
        right = bool(numbers) and int(numbers[-1]) == a + b
        self.index += 1
        verdict = "Right." if right else f"Wrong: {a} + {b} = {a + b}."
        done = self.index == self.problems
        observation = verdict if done else f"{verdict} {self._ask()}"
        return observation, (1.0 / self.problems if right else 0.0), done, False, {}


gymnasium.register(id="ArithmeticDrill-v0", entry_point=ArithmeticDrill, max_episode_steps=10)
