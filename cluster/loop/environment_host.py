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

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from grpo.environments import Observation, Turn, make_environment

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


class LocalEnvironments:
    """Environments in this process, ``parallel`` steps at a time in threads (:class:`EnvironmentHost`).

    Args:
        name, options: the environment (``rollout.multi_turn.environment``/``options``).
        parallel: steps at once. timeout_s: a step (or a reset) still running after this many seconds is an
            :class:`EnvironmentFailure`; its thread is abandoned (a new pool serves the next calls).
    """

    def __init__(self, name: str, options: Mapping[str, Any], parallel: int, timeout_s: float):
        self.name, self.options, self.parallel, self.timeout_s = name, dict(options), parallel, timeout_s
        self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="environment")

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
        """Step each environment with its turn; a step that raises, returns something else than an
        ``Observation``, or times out is an :class:`EnvironmentFailure`."""
        def stepper(env, turn: Turn) -> Callable[[], Observation]:
            def run():
                out = env.step(turn)
                if not isinstance(out, Observation):
                    raise TypeError(f"{type(env).__name__}.step returned {type(out).__name__}, expected an "
                                    f"Observation")
                return out
            return run

        return self._run_all([stepper(env, turn) for env, turn in steps], "step")

    def close(self, handles: Sequence[object]) -> None:
        """Close each environment (its errors are ignored: the episode is over)."""
        for env in handles:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - nothing depends on a clean close
                pass

    def shutdown(self) -> None:
        """Stop the worker threads (running steps are not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run_all(self, calls: Sequence[Callable[[], Any]], what: str) -> list[StepOutcome]:
        """Run ``calls`` on the pool; each gets ``timeout_s`` from when it starts."""
        started: dict[int, float] = {}
        outcomes: list[StepOutcome | None] = [None] * len(calls)

        def timed(i: int, call: Callable[[], Any]) -> tuple[Any, float]:
            started[i] = time.monotonic()
            return call(), time.monotonic() - started[i]

        futures: dict[Future, int] = {self._pool.submit(timed, i, call): i for i, call in enumerate(calls)}
        pending = set(futures)
        while pending:
            now = time.monotonic()
            deadlines = [started[futures[f]] + self.timeout_s for f in pending if futures[f] in started]
            done, pending = wait(pending, timeout=max(0.0, min(deadlines, default=now + self.timeout_s) - now),
                                 return_when=FIRST_COMPLETED)
            for f in done:
                i = futures[f]
                try:
                    value, seconds = f.result()
                    outcomes[i] = StepOutcome(value, seconds)
                except Exception as exc:  # noqa: BLE001 - any failure of an environment is an infra failure
                    seconds = time.monotonic() - started.get(i, time.monotonic())
                    outcomes[i] = StepOutcome(EnvironmentFailure(
                        f"environment {self.name!r} raised in {what}: {type(exc).__name__}: {exc}"), seconds)
            overdue = [f for f in pending if futures[f] in started and
                       time.monotonic() - started[futures[f]] >= self.timeout_s]
            for f in overdue:
                outcomes[futures[f]] = StepOutcome(EnvironmentFailure(
                    f"environment {self.name!r} {what} did not return within rollout.multi_turn.step_timeout_s="
                    f"{self.timeout_s:g}"), self.timeout_s)
                pending.discard(f)
            if overdue:  # its thread cannot be stopped: the calls not started yet move to fresh workers
                old, self._pool = self._pool, self._new_pool()
                for f in list(pending):
                    i = futures[f]
                    if i not in started and f.cancel():
                        pending.discard(f)
                        moved = self._pool.submit(timed, i, calls[i])
                        futures[moved] = i
                        pending.add(moved)
                old.shutdown(wait=False)
        return list(outcomes)
