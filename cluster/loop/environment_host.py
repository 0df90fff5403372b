"""Where episodes' environments run: :class:`EnvironmentHost`, the loop's seam, and :class:`LocalEnvironments`, the
in-process host (threads in the driver's process).

Environments run where rewards run — in the driver's process here; a reward pool (Ray actors, local processes) can
host them behind the same protocol — never on the rollout engines, whose actors only sample tokens. A host builds one
environment per episode (``grpo.environments.make_environment`` with the spec's options), steps many episodes at once
and turns every failure of an environment (it raised, or did not return within ``rollout.multi_turn.step_timeout_s``)
into an :class:`EnvironmentFailure` value: an infrastructure failure of that episode, never an exception that stops
the step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from contract.goodput import PoolTime
from grpo.environments import Observation, Turn, check_observation, make_environment

__all__ = ["EnvironmentFailure", "EnvironmentHost", "LocalEnvironments", "StepOutcome"]


@dataclass(frozen=True)
class EnvironmentFailure:
    """An environment that raised or timed out: ``message`` says which and why."""

    message: str


@dataclass(frozen=True)
class StepOutcome:
    """One episode's environment step: its observation or failure, and the step's wall seconds."""

    result: Observation | EnvironmentFailure
    seconds: float


class EnvironmentHost(Protocol):
    """Runs episodes' environments for the loop (``cluster.loop.episodes``)."""

    def open(self, rows: Sequence[Mapping[str, Any]]) -> list[object | EnvironmentFailure]:
        """One fresh environment per row, reset with it; a handle each (or the failure)."""
        ...

    def step(self, steps: Sequence[tuple[object, Turn]]) -> list[StepOutcome]:
        """Step every (handle, turn) pair, at once where the host can; outcomes in order."""
        ...

    def close(self, handles: Sequence[object]) -> None:
        """Release the environments (failures to close are ignored)."""
        ...

    def shutdown(self) -> None:
        """Stop the host (the job is ending)."""
        ...


def _closer(env: object) -> Callable[[], None]:
    """A call closing ``env`` (an environment without ``close`` raises in its thread, like any failing close)."""
    return lambda: env.close()


class LocalEnvironments:
    """Environments in this process, ``parallel`` calls at a time, each in a daemon thread (:class:`EnvironmentHost`).

    Args:
        name, options: the environment (``rollout.multi_turn.environment``/``options``).
        parallel: calls (builds + resets, steps, closes) at once. timeout_s: a call still running after this many
            seconds is an :class:`EnvironmentFailure` (a close that overruns is given up); its thread is abandoned.
            The threads are daemons: an environment that never returns neither blocks the loop nor keeps the
            process from exiting.
    """

    def __init__(self, name: str, options: Mapping[str, Any], parallel: int, timeout_s: float):
        self.name, self.options, self.parallel, self.timeout_s = name, dict(options), parallel, timeout_s
        self._busy_s = 0.0  # slot-seconds of environment calls (builds + resets, steps, closes) so far

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: ``parallel`` slots (pool ``environment``) and the seconds their calls
        took so far (an overrunning call's until its timeout); no cores of their own (threads of this process)."""
        return [PoolTime("environment", self.parallel, self._busy_s)]

    def open(self, rows: Sequence[Mapping[str, Any]]) -> list[object | EnvironmentFailure]:
        """Build and reset one environment per row (in the worker threads, within the timeout)."""
        def opener(row: Mapping[str, Any]) -> Callable[[], object]:
            def run():
                env = make_environment(self.name, self.options)
                try:
                    env.reset(row)
                except BaseException:
                    env.close()
                    raise
                return env
            return run

        return [o.result for o in self._run_all([opener(row) for row in rows], "reset")]

    def step(self, steps: Sequence[tuple[object, Turn]]) -> list[StepOutcome]:
        """Step each environment with its turn; a step that raises, returns something else than a well-formed
        ``Observation`` (:func:`grpo.environments.check_observation`), or times out is an
        :class:`EnvironmentFailure`."""
        def stepper(env, turn: Turn) -> Callable[[], Observation]:
            def run():
                out = env.step(turn)
                problem = check_observation(out)
                if problem is not None:
                    raise TypeError(f"{type(env).__name__}.step returned {problem}")
                return out
            return run

        return self._run_all([stepper(env, turn) for env, turn in steps], "step")

    def close(self, handles: Sequence[object]) -> None:
        """Close each environment, within the timeout (its errors are ignored: the episode is over)."""
        self._run_all([_closer(env) for env in handles], "close")

    def shutdown(self) -> None:
        """Nothing to stop: calls run in daemon threads of their own (an abandoned one is not waited for)."""

    def _run_all(self, calls: Sequence[Callable[[], Any]], what: str) -> list[StepOutcome]:
        """Run ``calls``, ``parallel`` at a time, each in a daemon thread; each gets ``timeout_s`` from its start.
        Outcomes in order: the value, or an :class:`EnvironmentFailure` for a call that raised (anything but
        ``KeyboardInterrupt``, ``SystemExit`` included) or overran."""
        results: queue.SimpleQueue = queue.SimpleQueue()
        outcomes: list[StepOutcome | None] = [None] * len(calls)
        waiting, running = deque(range(len(calls))), {}

        def timed(i: int) -> None:
            t0 = time.monotonic()
            try:
                value, error = calls[i](), None
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - any failure of an environment is an infra failure
                value, error = None, exc
            results.put((i, value, error, time.monotonic() - t0))

        while waiting or running:
            while waiting and len(running) < self.parallel:
                i = waiting.popleft()
                running[i] = time.monotonic()
                threading.Thread(target=timed, args=(i,), name=f"environment-{what}", daemon=True).start()
            deadline = min(running.values()) + self.timeout_s
            try:
                i, value, error, seconds = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                i = None
            if i is not None:
                running.pop(i)
                self._busy_s += seconds
                outcomes[i] = StepOutcome(value if error is None else EnvironmentFailure(
                    f"environment {self.name!r} raised in {what}: {type(error).__name__}: {error}"), seconds)
            for j in [j for j, t0 in running.items() if time.monotonic() - t0 >= self.timeout_s]:
                running.pop(j)
                self._busy_s += self.timeout_s
                outcomes[j] = StepOutcome(EnvironmentFailure(
                    f"environment {self.name!r} {what} did not return within rollout.multi_turn.step_timeout_s="
                    f"{self.timeout_s:g}"), self.timeout_s)
        return list(outcomes)
