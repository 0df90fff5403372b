"""Stand-in collaborators for :class:`cluster.driver.GRPOJob`: a fleet and a trainer that follow the
``contract.protocols`` without any model, for tests of the loop's wiring (schedules, checkpoints, resume, eval, the
guard) in milliseconds. The in-process runtime (``cluster.in_process``) is the real thing without Ray.

- :class:`StandInFleet`: every group is stamped with the policy version the fleet's last sync gave it; completions
  are ``[7] * (1 + i)`` with text ``"x" * (1 + i)`` (a test reward can score by length); each generate call is
  recorded as (thread name, version, recover).
- :class:`StandInTrainer`: one version per train step (``on_train`` runs first: a test can wait there for the
  producer thread); checkpoints hold a marker file; ``load_checkpoint`` continues at the given version.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from contract.figures import FleetFigures
from contract.messages import GroupRequest, GroupResult, TrainResult


class StandInTrainer:
    """A ``contract.protocols.Trainer`` that trains nothing.

    Args:
        on_train: called as ``on_train(trainer)`` at the start of every train step (None: nothing).
        skip: step numbers (1-based count of train_step calls) whose update is skipped as non-finite.

    Attributes:
        version: the policy version it holds. steps: train_step calls. starts, stops: lifecycle calls.
        kl_coefs: every β set. lrs: every learning rate set. policy_paths: the ``policy_path`` of every start.
    """

    world_size = 1

    def __init__(self, on_train=None, skip: tuple[int, ...] = ()):
        self.on_train, self.skip = on_train, set(skip)
        self.version, self.steps, self.starts, self.stops = 0, 0, 0, 0
        self.num_parameters = 0
        self.kl_coefs: list[float] = []
        self.lrs: list[float] = []
        self.policy_paths: list[str | None] = []

    def check(self, model_path: str) -> None:
        pass

    def start(self, model_path: str, policy_path: str | None = None) -> None:
        self.starts += 1
        self.policy_paths.append(policy_path)
        if policy_path is not None:
            self.version = json.loads((Path(policy_path) / "stand_in_policy.json").read_text())["version"]

    def set_kl_coef(self, kl_coef: float) -> None:
        self.kl_coefs.append(kl_coef)

    def set_lr(self, lr: float) -> None:
        self.lrs.append(lr)

    def train_step(self, per_rank, num_tokens: int, num_sequences: int) -> TrainResult:
        if self.on_train is not None:
            self.on_train(self)
        self.steps += 1
        skipped = self.steps in self.skip
        if not skipped:
            self.version += 1
        return TrainResult(self.version, skipped, "actor/loss" if skipped else "",
                           {"actor/kl": 0.0, "perf/train_tokens": float(num_tokens), "rollout/logprob_diff": 0.0},
                           kl=0.0)

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        (Path(folder) / "stand_in_policy.json").write_text(json.dumps({"version": self.version}))

    def load_checkpoint(self, path: str, policy_version: int) -> dict:
        self.version = policy_version
        return {}

    def describe(self) -> str:
        return "stand-in trainer"

    def shutdown(self) -> None:
        self.stops += 1


class StandInFleet:
    """A ``contract.protocols.Fleet`` whose groups are stamped with the version its last sync gave it.

    Attributes:
        version: the version it holds. calls: (thread name, version, recover) of every generate call.
        syncs: sync_policy calls. engines: engines it reports. interrupts: epochs it was interrupted with.
    """

    def __init__(self, engines: int = 1):
        self.figures = FleetFigures()
        self.version: int | None = None
        self.versions = None
        self.calls: list[tuple[str, int, bool]] = []
        self.syncs = 0
        self.engines = engines
        self.interrupts: list[int] = []
        self.lock = threading.Lock()

    def check(self, model_path: str) -> None:
        pass

    def start(self, weights_path: str, policy_version: int, trainer, versions, status) -> None:
        self.version, self.versions = policy_version, versions

    @property
    def num_engines(self) -> int:
        return self.engines

    @property
    def restarts(self) -> int:
        return 0

    def begin_step(self, figures: FleetFigures | None = None) -> None:
        self.figures = figures if figures is not None else FleetFigures()

    def group(self, request: GroupRequest) -> GroupResult:
        """One group of G completions ``[7] * (1 + i)`` at :attr:`version` (a subclass may change it)."""
        g = request.group_size or 2
        return GroupResult(request.group_id, request.prompt_ids, [[7] * (1 + i) for i in range(g)],
                           [torch.zeros(1 + i) for i in range(g)], ["length"] * g, ["x" * (1 + i) for i in range(g)],
                           self.version)

    def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
        with self.lock:
            self.calls.append((threading.current_thread().name, self.version, recover))
        groups = [self.group(q) for q in requests]
        if on_groups is not None:
            on_groups(groups)
        return groups

    def interrupt(self, epoch: int) -> None:
        self.interrupts.append(epoch)

    def sync_policy(self):
        self.syncs += 1
        self.version = self.versions.current
        return SimpleNamespace(metrics=lambda: {"sync/verified": True}, policy_version=self.version,
                               adapter_checksum=None, merge_update_error=None)  # what the loop reads of a SyncReport

    def scale(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"rollout replicas must be >= 1, got {replicas}")
        self.engines = replicas

    def log_workers(self, sink, step: int, figures=None) -> None:
        pass

    def describe(self) -> str:
        return f"{self.engines} stand-in engine(s)"

    def shutdown(self) -> None:
        pass


def stand_in_job(spec, **job_kwargs):
    """A :class:`cluster.driver.GRPOJob` over a fresh :class:`StandInFleet` and :class:`StandInTrainer`."""
    from cluster.driver import GRPOJob

    return GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), **job_kwargs)
