"""Fault injection on the Ray fleet, kept out of production code: :class:`FaultyFleet` is the
:class:`cluster.ray_shell.fleet.EngineFleet` that runs a fault (e.g. :func:`kill_engine`) just before the first
rollout of a given step; a test gives it to the job as its fleet::

    GRPOJob(spec, fleet=FaultyFleet(spec, {2: kill_engine(0)}), trainer=RayTrainer(spec), progress=False)

Train-side faults (non-finite steps, crashing ranks) are in ``tests/faults.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import ray

from cluster.ray_shell.fleet import EngineFleet


class FaultyFleet(EngineFleet):
    """:class:`cluster.ray_shell.fleet.EngineFleet` that calls ``faults[k](fleet)`` once, just before the first
    rollout of its k-th step (steps counted by ``begin_step`` from this fleet's creation; held-out evaluation calls
    are not rollouts). The fleet then handles whatever the fault did, as in production.

    Args:
        spec: the job spec.
        faults: step → fault, e.g. ``{2: kill_engine(0)}``.
    """

    def __init__(self, spec, faults: Mapping[int, Callable]):
        super().__init__(spec)
        self.faults = dict(faults)
        self.steps = 0

    def begin_step(self, figures=None) -> None:
        super().begin_step(figures)
        self.steps += 1

    def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
        fault = self.faults.pop(self.steps, None) if record else None
        if fault is not None:
            fault(self)
        return super().generate(requests, on_groups, record=record, recover=recover, interrupt_epoch=interrupt_epoch)


def kill_engine(index: int = 0) -> Callable:
    """A :class:`FaultyFleet` fault: ``ray.kill`` engine ``index`` (no restart), as when its process dies."""
    def kill(fleet) -> None:
        ray.kill(fleet.rollout.engines[index], no_restart=True)

    return kill
