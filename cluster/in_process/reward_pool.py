"""The in-process runtime's reward pool: ``reward_pool.workers`` local worker processes, or threads where the reward
functions cannot be sent to another process.

    pool = local_reward_pool(spec)     # InlineRewardPool with workers 0 (the default), else a WorkerPool
    job = GRPOJob(spec, fleet=..., trainer=..., reward_pool=pool)   # local_job does this

Which workers:

- **processes** (the normal case): each worker is a fresh Python interpreter started with ``subprocess``
  (``cluster.rewards.stdio``: not ``multiprocessing``, so the caller's ``__main__`` is never imported again and a
  reward function may start processes of its own) that loads the job's reward functions
  (``cluster.rewards.worker.RewardPlan``: registered functions are pickled by reference, spec-named ones loaded again
  from the spec's folder) and scores one chunk at a time. A call that runs past ``reward_pool.timeout_s`` kills the
  process; a process that dies (killed for memory, ``os._exit`` in a verifier) loses its chunk; either way a fresh
  process takes its place.
- **threads**, when the plan cannot be pickled (a reward function defined inside a function, a lambda, one defined
  in the script run as ``__main__``, a callable holding a lock): the calls run in the driver's process, each in a
  thread of its own. A timed-out call's rows get no score and its thread is left to finish on its own (threads
  cannot be killed); a thread worker never dies.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading

from cluster.rewards.calls import evaluate_call
from cluster.rewards.inline import InlineRewardPool
from cluster.rewards.pool import WorkerLost, WorkerPool
from cluster.rewards.stdio import CHILD_COMMAND, parent_connections
from cluster.rewards.worker import RewardPlan, WireError, build_plan, raise_wire_error
from contract.rewards import RewardCall, RewardScores
from grpo.rewards.calling import RewardError

__all__ = ["ProcessRewardWorker", "ThreadRewardWorker", "local_reward_pool", "plan_pickles"]

logger = logging.getLogger(__name__)


class ProcessRewardWorker:
    """A worker process holding the plan's reward functions (``cluster.rewards.pool.RewardWorker``).

    Args:
        plan: the reward functions to load. start_timeout_s: seconds to wait for it to load them.

    Raises:
        RewardError: a function did not load in the process (the message names it). WorkerLost: the process died
            or did not get ready within ``start_timeout_s``.
    """

    def __init__(self, plan: RewardPlan, start_timeout_s: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.process = subprocess.Popen([sys.executable, "-c", CHILD_COMMAND], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self._sender, self._receiver = parent_connections(self.process)
        try:
            self._sender.send(plan)
            ready = self._receive(start_timeout_s, "to load the reward functions")
        except (WorkerLost, OSError):
            self.close()
            raise
        if isinstance(ready, WireError):
            self.close()
            raise_wire_error(ready)

    @property
    def pid(self) -> int:
        """The worker process's pid."""
        return self.process.pid

    def _receive(self, timeout_s: float, what: str):
        try:
            if not self._receiver.poll(timeout_s):
                raise WorkerLost(f"reward worker process {self.pid} took more than {timeout_s:g} s {what}",
                                 timed_out=True)
            return self._receiver.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = "none yet: its output pipe closed"
            raise WorkerLost(f"reward worker process {self.pid} died (exit code {code}) {what}") from exc

    def call(self, call: RewardCall, timeout_s: float) -> RewardScores:
        """Score ``call`` in the process (``cluster.rewards.pool.RewardWorker.call``)."""
        try:
            self._sender.send(call)
        except OSError as exc:  # a closed pipe: the process is gone
            raise WorkerLost(f"reward worker process {self.pid} cannot be reached: {exc}") from None
        result = self._receive(timeout_s, f"to score {len(call)} completions")
        if isinstance(result, WireError):
            raise_wire_error(result)
        return result.scores()

    def close(self) -> None:
        """Kill the process and wait for it (idempotent)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._sender.close()
        self._receiver.close()


class ThreadRewardWorker:
    """Calls in threads of the driver's process, for reward functions that cannot be pickled (module docstring);
    they are already registered here."""

    def call(self, call: RewardCall, timeout_s: float) -> RewardScores:
        """Score ``call`` in a thread of its own; past ``timeout_s`` the call is abandoned (its thread runs on).

        Raises:
            WorkerLost: the timeout. RewardError: as the reward functions raise it.
        """
        box: dict = {}

        def run() -> None:
            try:
                box["scores"] = evaluate_call(call)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="reward-thread-call", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise WorkerLost(f"a reward call of {len(call)} completions took more than {timeout_s:g} s (its thread is "
                             f"left running: threads cannot be killed)", timed_out=True)
        if "error" in box:
            if isinstance(box["error"], RewardError):
                raise box["error"]
            raise RewardError(f"reward call: {type(box['error']).__name__}: {box['error']}") from box["error"]
        return box["scores"]

    def close(self) -> None:
        pass


def plan_pickles(plan: RewardPlan) -> str | None:
    """None when ``plan`` can be sent to a worker process, else why not (a function that does not pickle, or one
    defined in ``__main__``, which the worker's own ``__main__`` does not have)."""
    main = [name for name, fn in plan.functions.items() if getattr(fn, "__module__", None) == "__main__"]
    if main:
        return f"reward function(s) {main} are defined in __main__"
    try:
        pickle.dumps(plan)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def local_reward_pool(spec, imports: tuple[str, ...] = ()):
    """The in-process runtime's reward pool for ``spec`` (``reward_pool``): :class:`InlineRewardPool` with workers 0,
    else a :class:`WorkerPool` of :class:`ProcessRewardWorker` s (or :class:`ThreadRewardWorker` s, module docstring)
    for the functions of ``algorithm.rewards``, as they are registered now (after the spec was validated).

    Raises:
        RewardError: a reward function of the spec is not registered in this process.
    """
    rp = spec.reward_pool
    if rp.workers == 0:
        return InlineRewardPool()
    plan = build_plan(spec.algorithm.rewards, imports)
    why = plan_pickles(plan)
    if why is None:
        def make(index: int) -> ProcessRewardWorker:
            return ProcessRewardWorker(plan, rp.start_timeout_s)

        return WorkerPool(make, rp.workers, rp.batch_size, rp.timeout_s, "local processes")
    logger.warning("reward pool: the reward functions cannot be sent to a worker process (%s); they run in threads "
                   "of this process", why)
    return WorkerPool(lambda index: ThreadRewardWorker(), rp.workers, rp.batch_size, rp.timeout_s, "threads")
