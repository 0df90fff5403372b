"""``cluster.loop.job_workers.JobWorkers``: the job's worker-running collaborators started, stopped and steered
together — a part that fails to start stops what started (the error goes on), and a replica count set by
``grpo-cluster scale`` resizes the fleet between steps and the job's state is published with the fleet's figures."""

from __future__ import annotations

import pytest

from cluster.loop.job_workers import JobWorkers
from contract.versions import PolicyVersionLedger


class Part:
    """A collaborator that records its calls; ``fail`` makes its ``start`` raise."""

    def __init__(self, log: list[str], name: str, fail: bool = False):
        self.log = log
        self.name = name
        self.fail = fail
        self.num_engines = 1
        self.restarts = 2

    def start(self, *args, **kwargs) -> None:
        self.log.append(f"{self.name}.start")
        if self.fail:
            raise RuntimeError(f"{self.name} did not start")

    def shutdown(self) -> None:
        self.log.append(f"{self.name}.shutdown")

    def scale(self, replicas: int) -> None:
        self.log.append(f"{self.name}.scale({replicas})")
        self.num_engines = replicas


class Control:
    def __init__(self, desired: int | None):
        self.desired = desired
        self.reports = []
        self.closed = 0

    def desired_rollout_replicas(self) -> int | None:
        return self.desired

    def report(self, state: dict) -> None:
        self.reports.append(state)

    def close(self) -> None:
        self.closed += 1


def _workers(log, control=None, fail=""):
    fleet, trainer, rewards = (Part(log, name, fail == name) for name in ("fleet", "trainer", "rewards"))
    return JobWorkers(fleet, trainer, rewards, agent_pool=None, agent_endpoint=None, control=control,
                      status=log.append), fleet


def test_a_part_that_fails_to_start_stops_the_others_and_the_error_goes_on():
    log: list[str] = []
    workers, _ = _workers(log, fail="fleet")
    with pytest.raises(RuntimeError, match="fleet did not start"):
        workers.start("model", None, PolicyVersionLedger(), lora=False)
    assert log == ["trainer.start", "fleet.start", "fleet.shutdown", "trainer.shutdown", "rewards.shutdown"]


def test_a_scale_request_resizes_the_fleet_and_the_state_is_published():
    log: list[str] = []
    control = Control(desired=3)
    workers, fleet = _workers(log, control)
    workers.apply_control({"step": 4, "policy_version": 4, "total_steps": 10})
    assert log == ["fleet.scale(3)"] and fleet.num_engines == 3
    assert control.reports == [{"step": 4, "policy_version": 4, "total_steps": 10, "rollout_replicas": 3,
                                "engine_restarts": 2}]
    workers.apply_control({"step": 5, "policy_version": 5, "total_steps": 10})  # already at 3: no second scale
    assert log == ["fleet.scale(3)"] and len(control.reports) == 2
    workers.close_control()
    workers.close_control()
    assert control.closed == 1
    workers.apply_control({"step": 6, "policy_version": 6, "total_steps": 10})  # closed: nothing
    assert len(control.reports) == 2


class Described(Part):
    def describe(self) -> str:
        return {"fleet": "1 engine(s)", "trainer": "1 train rank(s)", "rewards": "reward functions in the driver",
                "agents": "1 agent worker(s) (function, 8 episodes each at once)"}[self.name]


def test_start_line_of_an_agent_job_says_the_agent_scores_its_episodes():
    """An agent job has no reward functions (the agent returns the reward): its start-up line must not say it has
    some in the driver. A job without agents still names its reward pool."""
    log: list[str] = []
    fleet, trainer, rewards, agents = (Described(log, name) for name in ("fleet", "trainer", "rewards", "agents"))
    plain = JobWorkers(fleet, trainer, rewards, agent_pool=None, agent_endpoint=None, control=None,
                       status=log.append)
    assert plain.describe() == "1 engine(s), 1 train rank(s), reward functions in the driver"
    agent = JobWorkers(fleet, trainer, rewards, agent_pool=agents, agent_endpoint=None, control=None,
                       status=log.append)
    assert agent.describe() == ("1 engine(s), 1 train rank(s), no reward functions: the agent scores its episodes, "
                                "1 agent worker(s) (function, 8 episodes each at once)")
