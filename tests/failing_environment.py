"""An environment that raises on its first step (``failing``), registered on import: the infrastructure failure of
an environment run on the agent pool (``--import tests.failing_environment`` in the workers)."""

from __future__ import annotations

from grpo.environments import ENVIRONMENTS, EnvironmentInfraError


class FailingEnvironment:
    """Raises :class:`EnvironmentInfraError` on every step."""

    def __init__(self, **options):
        self.options = options

    def reset(self, row):
        pass

    def step(self, turn):
        raise EnvironmentInfraError("the sandbox is down")

    def close(self):
        pass


if "failing" not in ENVIRONMENTS:
    ENVIRONMENTS["failing"] = FailingEnvironment
