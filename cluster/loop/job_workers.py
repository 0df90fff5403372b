"""The job's collaborators that run workers — the fleet, the trainer, the reward pool, with agents the agent pool and
the endpoint, and the operator's control channel — started, stopped and scaled together (:class:`JobWorkers`, a
collaborator of ``cluster.driver.GRPOJob``).
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.loop.training import load_train_state
from contract.agents import AgentEndpoint, AgentPool
from contract.protocols import ControlChannel, Fleet, RewardPool, Trainer
from contract.versions import PolicyVersionLedger


class JobWorkers:
    """Start, stop and steer one job's worker-running collaborators.

    Args:
        fleet, trainer: the rollout side and the train side (``contract.protocols``), not started.
        reward_pool: where the reward functions run, not started.
        agent_pool, agent_endpoint: the agents' pool and the rollout side's chat-completions endpoint, or None.
        control: how an operator steers the job between steps (``grpo-cluster scale``), or None.
        status: one-line console messages.
    """

    def __init__(self, fleet: Fleet, trainer: Trainer, reward_pool: RewardPool, *, agent_pool: AgentPool | None,
                 agent_endpoint: AgentEndpoint | None, control: ControlChannel | None,
                 status: Callable[[str], None]):
        self.fleet = fleet
        self.trainer = trainer
        self.reward_pool = reward_pool
        self.agent_pool = agent_pool
        self.agent_endpoint = agent_endpoint
        self.control = control
        self._status = status

    def start(self, model_path: str, checkpoint: str | None, versions: PolicyVersionLedger, *, lora: bool) -> None:
        """Start the trainer (from the model, or from ``checkpoint`` with its optimizer state), the fleet (engines at
        the trainer's policy version, joined to its weight sync), the reward pool and the agent parts. With
        ``lora`` a checkpoint holds adapters only: the engines start from the base model and are synced to it. What
        started is stopped again when a part fails to start (the error is re-raised)."""
        try:
            self.trainer.start(model_path, policy_path=checkpoint)
            if checkpoint is not None:
                self._load_optimizer(checkpoint, versions.current)
            engine_weights = model_path if lora or checkpoint is None else checkpoint
            self.fleet.start(engine_weights, versions.current, self.trainer, versions, self._status)
            if lora and checkpoint is not None:
                self.fleet.sync_policy()  # the base model's engines get the checkpoint's policy (merged or adapters)
            self.reward_pool.start()
            for part in (self.agent_endpoint, self.agent_pool):
                if part is not None and hasattr(part, "start"):
                    part.start()
        except BaseException:
            self.stop()
            raise

    def _load_optimizer(self, checkpoint: str, policy_version: int) -> None:
        """The train ranks load ``checkpoint``'s optimizer state; fields the spec changed are said."""
        changed = load_train_state(self.trainer, checkpoint, policy_version)
        if changed:  # the spec's values are in use (what actor/lr etc. report), not the checkpoint's
            self._status("optimizer fields changed from the checkpoint (saved -> in use): " + ", ".join(
                f"{field} {saved!r} -> {used!r}" for field, (saved, used) in changed.items()))

    def describe(self) -> str:
        """One line: the fleet, the trainer, then where the rewards come from: the reward pool, or with agents the
        agent pool (an agent job has no reward functions, ``cluster.spec.agents.agent_conflicts``: its agents return
        their episodes' rewards)."""
        if self.agent_pool is None:
            rewards = self.reward_pool.describe()
        else:
            rewards = f"no reward functions: the agent scores its episodes, {self.agent_pool.describe()}"
        return f"{self.fleet.describe()}, {self.trainer.describe()}, {rewards}"

    def stop(self) -> None:
        """Stop the agent pool and the endpoint, the fleet, the trainer and the reward pool (each idempotent); they
        can :meth:`start` again."""
        for part in (self.agent_pool, self.agent_endpoint, self.fleet, self.trainer, self.reward_pool):
            if part is not None and hasattr(part, "shutdown"):
                part.shutdown()

    def close_control(self) -> None:
        """Close the control channel (once)."""
        if self.control is not None:
            self.control.close()
            self.control = None

    def apply_control(self, state: dict) -> None:
        """Apply a replica count set by ``grpo-cluster scale`` (:meth:`Fleet.scale`, between steps) and publish the
        job's ``state`` (step, policy version, total steps) with the fleet's replicas and engine restarts."""
        if self.control is None:
            return
        desired = self.control.desired_rollout_replicas()
        if desired is not None and desired != self.fleet.num_engines:
            self.fleet.scale(int(desired))
        self.control.report({**state, "rollout_replicas": self.fleet.num_engines,
                             "engine_restarts": self.fleet.restarts})
