"""Preemption: what the job does on SIGTERM, within ``checkpoint.on_preempt.deadline_s`` (docs/operations.md,
"Preemption").

Who sends it: ``ray job stop`` / ``grpo-cluster stop`` (Ray's JobSupervisor sends SIGTERM to the driver and its child
processes, then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S``, default 3 s, read from the job's runtime env: ``grpo-cluster
submit`` sets it above the deadline) and a Kubernetes pod eviction (the head pod's preStop hook, deploy/k8s, sends it
to the driver; the pod is killed after ``terminationGracePeriodSeconds``).

What the job does, by where the SIGTERM finds it:

* start-up (workers starting) and the starting weights' evaluation (step 0): abandoned at once. Nothing was trained
  since the checkpoint resumed (or since step 0), so nothing is written.
* step k before its update (generation, scoring, dynamic-sampling rounds): abandoned at once (the main thread's wait
  is interrupted; what the engines still sample is dropped). The trainer has not touched its weights, so the checkpoint
  holds step k − 1, with the driver state recorded when step k began: the data position before step k drew its
  prompts (batches generated ahead counted in flight). On resume step k draws the same prompts with the same seeds,
  as after a crash.
* step k from its update on (train, sync, the step's row, its evaluation, a periodic checkpoint, the guard): finished,
  since the weights are changing and a checkpoint of step k − 1 can no longer be written; the checkpoint holds step k.
  A checkpoint of that step already complete (``checkpoint.every_steps``) is not written again.

Either way the checkpoint is the one a periodic save at that step writes, so a resumed run repeats the uninterrupted
run's metrics (``rollout.mode: sync``; one_step_off and async sample the batches in flight again on the checkpoint's
weights, as after any resume). Then ``GRPOJob.run`` raises :class:`Preempted`; the caller shuts the workers down and
exits with :data:`PREEMPTED_EXIT_CODE` (``grpo-cluster run`` prints a one-line resume hint).

Mechanics: the SIGTERM handler counts the signal and notes its time, nothing else (no I/O, no lock: it runs between
two bytecodes of the main thread), except inside an abortable window (:meth:`Preemption.abortable`, closed when the
step's update begins: :meth:`Preemption.update_begins`), where it raises :class:`StepAborted` in the main thread. A
watchdog thread says each signal on the console in one line and, ``deadline_s`` after the first, ends the process
with :data:`PREEMPTED_EXIT_CODE` (``os._exit``): a checkpoint still being written stays ``step_NNNNNN.partial``, never
taken for a complete one, and the previous complete checkpoint stays the latest. A second SIGTERM changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from cluster.loop.checkpoints import TRAINER_STATE, latest_checkpoint

#: The driver's exit code after a SIGTERM, whether or not the checkpoint was written in time: EX_TEMPFAIL of
#: sysexits.h ("a temporary failure; the user is invited to retry"): continue with ``--resume``.
PREEMPTED_EXIT_CODE = 75

#: Seconds between the watchdog's looks at the signal count and the clock.
WATCH_INTERVAL_S = 0.1

#: Seconds past ``deadline_s`` a supervisor should wait before SIGKILL: the workers' shutdown after the checkpoint
#: (the deadline bounds that too, but a SIGKILL inside it cuts the one-line message and the exit code).
SHUTDOWN_MARGIN_S = 30

#: The variable of a Ray job's runtime env that Ray's JobSupervisor reads for the seconds between the SIGTERM of
#: ``ray job stop`` and its SIGKILL (default 3 s).
RAY_STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Preemption", "PreemptionTarget", "RAY_STOP_WAIT_ENV",
           "SHUTDOWN_MARGIN_S", "StepAborted", "kill_after_s"]


def kill_after_s(config) -> int:
    """Whole seconds after SIGTERM at which a supervisor may SIGKILL the driver without cutting its preemption short
    (``RAY_JOB_STOP_WAIT_TIME_S``, the pods' ``terminationGracePeriodSeconds``): ``checkpoint.on_preempt``'s
    ``deadline_s`` + :data:`SHUTDOWN_MARGIN_S`, rounded up."""
    return int(-(-float(config.deadline_s) // 1)) + SHUTDOWN_MARGIN_S


class StepAborted(KeyboardInterrupt):
    """Raised in the main thread by the SIGTERM handler inside an abortable window. A KeyboardInterrupt: no ``except
    Exception`` on its way (a reward function's, a retry loop's) swallows it, and it is the one exception Ray's
    blocking calls (``ray.get``, ``ray.wait``) let out of a signal handler, as a plain ``KeyboardInterrupt`` (any
    other is printed as unraisable and lost), which :meth:`Preemption.abortable` tells from a Ctrl-C by the
    handler's note."""


class Preempted(Exception):
    """The job stopped on SIGTERM after its preemption checkpoint (raised by ``GRPOJob.run``).

    Attributes:
        step: the step the latest complete checkpoint holds (0: none). checkpoint: that folder (None: there is none).
        written: this preemption wrote it. exit_code: :data:`PREEMPTED_EXIT_CODE`.
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, checkpoint: Path | None, written: bool):
        self.step = step
        self.checkpoint = checkpoint
        self.written = written
        if checkpoint is None:
            where = "no checkpoint yet (a resume starts from step 0)"
        else:
            where = f"{'wrote' if written else 'latest complete'} checkpoint {checkpoint} (step {step})"
        super().__init__(f"preempted by SIGTERM (exit code {PREEMPTED_EXIT_CODE}): {where}")


class PreemptionTarget(Protocol):
    """What :class:`Preemption` needs of the job (``cluster.driver.GRPOJob``)."""

    step: int

    def checkpoint_state(self) -> dict:
        """The driver state a checkpoint written now records (``trainer_state.json``, with its ``step``)."""
        ...

    def save_checkpoint(self, state: dict | None = None) -> Path:
        """Write the checkpoint of ``state`` (None: :meth:`checkpoint_state`); returns its folder."""
        ...


class Preemption:
    """The SIGTERM handler, the abortable windows and the deadline's watchdog of one job (module docstring).

    Args:
        config: ``checkpoint.on_preempt`` (``enabled``, ``deadline_s``).
        checkpoint_root: the job's checkpoint folder (the latest complete checkpoint is named from it).
        status: one-line console messages.
        exit_process: ends the process with a code when the deadline passes (``os._exit``; tests pass a recorder).
        clock: monotonic seconds.
    """

    def __init__(self, config, checkpoint_root: Path, status: Callable[[str], None],
                 exit_process: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic):
        self.enabled = bool(config.enabled)
        self.deadline_s = float(config.deadline_s)
        self.root = Path(checkpoint_root)
        self._status = status
        self._exit = exit_process
        self._clock = clock
        self.signals = 0  # SIGTERMs received (written only by the handler)
        self.received_at: float | None = None  # clock() at the first
        self.checkpoint_done = False  # the preemption's checkpoint is complete (or none is due)
        self._window = False  # the main thread is in an abortable window
        self._aborted = False  # the handler raised StepAborted (Ray may turn it into a plain KeyboardInterrupt)
        self._before_step: dict | None = None  # the driver state at the running step's start (json copy)
        self._previous_handler = None
        self._watchdog: threading.Thread | None = None
        self._stop_watching = threading.Event()
        self._said = 0  # signals said on the console
        self._saying = threading.Lock()  # the watchdog and the main thread both say them (never the handler)
        self._exited = False  # the deadline passed and the process was ended

    @property
    def requested(self) -> bool:
        """A SIGTERM was received."""
        return self.signals > 0

    # ---- arming ---------------------------------------------------------------------------------------------------
    @contextmanager
    def armed(self) -> Iterator[None]:
        """Handle SIGTERM (and watch the deadline) inside the block; the previous handler is restored on leaving,
        unless a preemption is in progress: then the handler and the watchdog stay until the process ends, so that
        a SIGTERM during the workers' shutdown is said in one line and the deadline still bounds it. Not armed when
        ``enabled`` is false, or off the main thread (Python runs signal handlers on the main thread only; said)."""
        if not self.enabled:
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            self._status("checkpoint.on_preempt: SIGTERM is not handled: the job does not run on the main thread")
            yield
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._stop_watching.clear()
        self._watchdog = threading.Thread(target=self._watch, name="preemption-watchdog", daemon=True)
        self._watchdog.start()
        try:
            yield
        finally:
            if not self.requested:
                self.disarm()

    def disarm(self) -> None:
        """Restore the previous SIGTERM handler and stop the watchdog (idempotent)."""
        if self._watchdog is None:
            return
        signal.signal(signal.SIGTERM, self._previous_handler)
        self._stop_watching.set()
        self._watchdog.join()
        self._watchdog = None

    def _on_sigterm(self, signum, frame) -> None:
        """The handler: count, note the time, and inside an abortable window raise :class:`StepAborted` (once)."""
        self.signals += 1
        if self.received_at is None:
            self.received_at = self._clock()
        if self._window:
            self._window = False
            self._aborted = True
            raise StepAborted()

    # ---- windows and safe points ----------------------------------------------------------------------------------
    @contextmanager
    def abortable(self, job: PreemptionTarget, state: dict | None = None) -> Iterator[None]:
        """A window a SIGTERM abandons at once (until :meth:`update_begins`): then :class:`Preempted` is raised
        after the checkpoint of ``state`` (the driver state the job returns to; None: nothing to write, the latest
        complete checkpoint stays)."""
        self._window = True
        try:
            if self.requested:  # arrived just before the window opened
                self._window = False
                self._aborted = True
                raise StepAborted()
            yield
        except KeyboardInterrupt:
            if not self._aborted:  # a Ctrl-C, not this SIGTERM
                raise
            raise self._stop(job, state, aborted=True) from None
        finally:
            self._window = False

    @contextmanager
    def step_in_flight(self, job: PreemptionTarget) -> Iterator[None]:
        """Around a step: abortable until its update begins, returning to the state :meth:`between_steps` kept."""
        with self.abortable(job, self._before_step):
            yield

    def update_begins(self) -> None:
        """The step's update begins (the trainer's weights change): from here the step is finished."""
        self._window = False

    def between_steps(self, job: PreemptionTarget) -> None:
        """A safe point between steps: after a SIGTERM, write the checkpoint of the job's state (unless one of this
        step is complete) and raise :class:`Preempted`; otherwise keep the state the next step returns to."""
        if self.requested:
            raise self._stop(job, job.checkpoint_state(), aborted=False)
        self._before_step = json.loads(json.dumps(job.checkpoint_state()))  # a copy the step cannot change

    def _stop(self, job: PreemptionTarget, state: dict | None, aborted: bool) -> Preempted:
        """Write the preemption checkpoint of ``state`` when one is due; returns the :class:`Preempted` to raise."""
        self.say_signals()
        written, path = False, None
        if aborted:
            self._status("preemption: start-up abandoned" if state is None else (
                f"preemption: step {job.step} abandoned before its update (what it sampled is dropped; its prompts "
                f"are drawn again on resume)"))
        step = int(state["step"]) if state is not None else 0
        path = self.root / f"step_{step:06d}"
        if step == 0:
            self._status("preemption: no step trained since the start: nothing to checkpoint")
        elif (path / TRAINER_STATE).is_file():
            self._status(f"preemption: the checkpoint of step {step} is already complete: {path}")
        else:
            self._status(f"preemption: writing the checkpoint of step {step}")
            written = self._save(job, state) is not None
        self.checkpoint_done = True
        self.say_signals()  # those that came while it was written
        latest = latest_checkpoint(self.root)
        return Preempted(int(latest.name[len("step_"):]) if latest else 0, latest, written)

    def _save(self, job: PreemptionTarget, state: dict) -> Path | None:
        """``job.save_checkpoint(state)``; an error is said in one line (the latest complete checkpoint stays)."""
        try:
            return job.save_checkpoint(state)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the process is going down: say it, keep the rest
            self._status(f"preemption: the checkpoint of step {state['step']} failed: {type(exc).__name__}: {exc}")
            return None

    # ---- the watchdog ---------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Say each new signal in one line; past the deadline, end the process (:data:`PREEMPTED_EXIT_CODE`)."""
        while not self._stop_watching.wait(WATCH_INTERVAL_S):
            self.check_deadline()

    def check_deadline(self) -> None:
        """One look of the watchdog: say the signals received since the last look; past the deadline, say so and
        end the process."""
        self.say_signals()
        first = self.received_at
        if first is not None and not self._exited and self._clock() - first >= self.deadline_s:
            self._exited = True
            self._deadline_passed()

    def say_signals(self) -> None:
        """Say each signal received and not said yet, in one line each."""
        with self._saying:
            count, first = self.signals, self.received_at
            while self._said < count:
                self._said += 1
                self._say(self._said, first)

    def _say(self, nth: int, first: float) -> None:
        if nth == 1:
            self._status(f"preemption: SIGTERM received: generation stops, the step in flight is finished or "
                         f"abandoned and a checkpoint written within checkpoint.on_preempt.deadline_s="
                         f"{self.deadline_s:g} s; then exit code {PREEMPTED_EXIT_CODE}")
        else:
            left = max(0.0, self.deadline_s - (self._clock() - first))
            self._status(f"preemption: SIGTERM again ({nth} received): ignored; the checkpoint is written until the "
                         f"deadline ({left:.0f} s left)")

    def _deadline_passed(self) -> None:
        latest = latest_checkpoint(self.root)
        if self.checkpoint_done:
            what = f"the workers were still shutting down (the checkpoint is complete: {latest})"
        else:
            what = (f"the checkpoint was not complete: none written (a .partial folder is never resumed from); the "
                    f"latest complete checkpoint is {latest if latest is not None else 'none (step 0)'}")
        self._status(f"preemption: checkpoint.on_preempt.deadline_s={self.deadline_s:g} s passed since SIGTERM and "
                     f"{what}; exiting with code {PREEMPTED_EXIT_CODE}; continue with --resume")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._exit(PREEMPTED_EXIT_CODE)
