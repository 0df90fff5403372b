"""What runs inside a reward worker (a Ray actor, a local process, a thread): the job's reward functions, loaded from
a :class:`RewardPlan`, and the scoring of one chunk (:class:`RewardWorkerCore`), with results in a plain wire form
(:class:`WireScores`, :class:`WireError`) that any transport pickles.

A worker process does not share the driver's reward registry, so the plan says how to get each function there:

- a function registered by name (builtins, ``--import`` modules, reward endpoints, a test's) travels as the
  function object itself, which pickling sends by reference (its module is imported in the worker) or, for Ray's
  cloudpickle, by value when it has no importable module;
- a function the spec named by location (``path/to/file.py:function``, ``module:function``) lives in a module the
  loader named itself, which no other process can import by that name: the worker loads it again from the spec
  file's folder (``grpo.rewards.loading.register_spec_reward``). That folder travels as an absolute path and, when
  it lies inside the working folder, also relative to it: a worker whose node has no such absolute path (a Ray job's
  working dir unpacked elsewhere) finds it relative to its own working folder.

Errors a reward function raises follow ``on_error`` inside :func:`cluster.rewards.calls.evaluate_call`; a broken
contract (wrong count, non-numbers) or a raise with ``on_error: raise`` comes back as a :class:`WireError` and is
raised again on the driver's side (:func:`raise_wire_error`) with its message, naming the function and its file.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cluster.rewards.calls import evaluate_call
from contract.rewards import RewardCall, RewardScores
from grpo.rewards import REWARD_FUNCTIONS
from grpo.rewards.calling import RewardError, RewardOutputError
from grpo.rewards.loading import is_location, register_spec_reward, spec_reward_base_dir

__all__ = ["RewardPlan", "RewardWorkerCore", "WireError", "WireScores", "build_plan", "load_plan", "raise_wire_error"]


@dataclass(frozen=True)
class RewardPlan:
    """How a worker gets the job's reward functions.

    Attributes:
        functions: registered name → the function object (sent by reference or by value).
        locations: spec key (``file.py:function``, ``module:function``) → the folder to load it from: (absolute
            path, path relative to the working folder or None when it lies outside it).
        imports: modules to import first (``--import``: they may register functions the others use).
    """

    functions: Mapping[str, Callable] = field(default_factory=dict)
    locations: Mapping[str, tuple[str, str | None]] = field(default_factory=dict)
    imports: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        """Every reward function name the plan provides."""
        return [*self.functions, *self.locations]


def build_plan(names: Iterable[str], imports: tuple[str, ...] = ()) -> RewardPlan:
    """The plan for reward functions ``names`` as this process has them registered (after the spec was validated).

    Raises:
        RewardError: a name that is not registered here.
    """
    functions, locations = {}, {}
    cwd = Path.cwd().resolve()
    for name in dict.fromkeys(names):
        base = spec_reward_base_dir(name) if is_location(name) else None
        if base is not None:
            locations[name] = (str(base), str(base.relative_to(cwd)) if base.is_relative_to(cwd) else None)
        elif name in REWARD_FUNCTIONS:
            functions[name] = REWARD_FUNCTIONS[name]
        else:
            raise RewardError(f"reward pool: reward function {name!r} is not registered in this process "
                              f"(registered: {', '.join(sorted(REWARD_FUNCTIONS))})")
    return RewardPlan(functions, locations, tuple(imports))


def load_plan(plan: RewardPlan) -> None:
    """Make every function of ``plan`` available in this process's ``grpo.rewards.REWARD_FUNCTIONS`` under its name.

    Raises:
        RewardError: an import of ``plan.imports`` or a spec-named function failed (naming the file and line).
    """
    for module in plan.imports:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported with its cause, never a traceback
            raise RewardError(f"reward worker: --import {module}: {type(exc).__name__}: {exc}") from None
    for name, fn in plan.functions.items():
        if REWARD_FUNCTIONS.get(name) is fn:
            continue
        if name in REWARD_FUNCTIONS:
            dict.__delitem__(REWARD_FUNCTIONS, name)  # the driver's function is the one the job uses
        REWARD_FUNCTIONS[name] = fn
    for key, (absolute, relative) in plan.locations.items():
        folder = absolute if os.path.isdir(absolute) or relative is None else os.path.join(os.getcwd(), relative)
        register_spec_reward(key, folder)


@dataclass(frozen=True)
class WireScores:
    """:class:`RewardScores` as plain lists (NaN for no score), for any transport."""

    total: list[float]
    per_function: dict[str, list[float]]
    num_failed: dict[str, int]

    @classmethod
    def of(cls, scores: RewardScores) -> WireScores:
        return cls(scores.total.tolist(), {k: v.tolist() for k, v in scores.per_function.items()},
                   dict(scores.num_failed))

    def scores(self) -> RewardScores:
        """Back to tensors ([N] float32)."""
        return RewardScores(torch.tensor(self.total, dtype=torch.float32),
                            {k: torch.tensor(v, dtype=torch.float32) for k, v in self.per_function.items()},
                            dict(self.num_failed))


@dataclass(frozen=True)
class WireError:
    """A reward error raised in a worker: ``kind`` ``"output"`` (a broken contract: ``RewardOutputError``) or
    ``"reward"`` (any other ``RewardError`` or a bad call); ``message`` as raised."""

    kind: str
    message: str


def raise_wire_error(error: WireError) -> None:
    """Raise ``error`` on this side as the type it had in the worker.

    Raises:
        RewardOutputError: kind ``"output"``. RewardError: otherwise.
    """
    if error.kind == "output":
        raise RewardOutputError(error.message)
    raise RewardError(error.message)


class RewardWorkerCore:
    """One reward worker's state: the plan's functions, loaded at construction.

    Args:
        plan: what to load (:func:`build_plan` in the driver).

    Raises:
        RewardError: a function could not be loaded here.
    """

    def __init__(self, plan: RewardPlan):
        load_plan(plan)
        self.names = plan.names
        self.pid = os.getpid()

    def score(self, call: RewardCall) -> WireScores | WireError:
        """Score one chunk; an error comes back as a :class:`WireError` (a reward function's own raise is handled by
        ``call.on_error`` before that): a broken contract, a raise with ``on_error="raise"``, or a bad call."""
        try:
            return WireScores.of(evaluate_call(call))
        except RewardOutputError as exc:
            return WireError("output", str(exc))
        except RewardError as exc:
            return WireError("reward", str(exc))
        except Exception as exc:  # noqa: BLE001 - a bad call (lengths, unknown names): fails the step, named
            return WireError("reward", f"reward worker: {type(exc).__name__}: {exc}")

