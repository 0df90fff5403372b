"""The in-process runtime's agent pool: ``rollout.agent_pool.workers`` local worker processes, each running many
episodes at once on its event loop (``cluster.agents.worker``), fed and watched by
:class:`cluster.agents.pool.AgentWorkerPool`.

    pool = local_agent_pool(spec)     # None without an agent (rollout.agent, multi_turn.runner agent_pool)
    job = GRPOJob(spec, fleet=..., trainer=..., agent_pool=pool, agent_endpoint=...)   # local_job does this

Each worker is a fresh Python interpreter started with ``subprocess`` (``cluster.agents.stdio``: not
``multiprocessing``, so the caller's ``__main__`` is never imported again and an agent may start processes of its
own) that imports the agent from the spec file's folder. A process that dies (killed for memory, ``os._exit`` in an
agent) loses its running episodes; one that stays silent past the episode timeout is killed; either way a fresh
process takes its place.
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future

from cluster.agents.loading import AgentLoadError
from cluster.agents.plan import AgentPlan, agent_kind_name, build_plan
from cluster.agents.pool import AgentWorkerLost, AgentWorkerPool
from cluster.agents.stdio import CHILD_COMMAND
from cluster.rewards.stdio import parent_connections
from contract.agents import AgentOutcome, EpisodeTicket

__all__ = ["ProcessAgentWorker", "local_agent_pool"]


class ProcessAgentWorker:
    """An agent worker process (``cluster.agents.pool.AgentWorker``), started and ready.

    Args:
        plan: the job's agent plan. start_timeout_s: seconds to wait for it to import the agent.

    Raises:
        AgentLoadError: the agent did not load in the process (the message names its file and line).
        AgentWorkerLost: the process died or was not ready within ``start_timeout_s``.
    """

    def __init__(self, plan: AgentPlan, start_timeout_s: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.process = subprocess.Popen([sys.executable, "-c", CHILD_COMMAND], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self._sender, self._receiver = parent_connections(self.process)
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closed = False
        try:
            self._sender.send(plan)
            if not self._receiver.poll(start_timeout_s):
                raise AgentWorkerLost(f"agent worker process {self.pid} was not ready within {start_timeout_s:g} s "
                                      f"(rollout.agent_pool.start_timeout_s)")
            kind, value = self._receiver.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.close()
            raise AgentWorkerLost(f"agent worker process {self.pid} died while starting: {type(exc).__name__}") \
                from None
        except AgentWorkerLost:
            self.close()
            raise
        if kind == "error":
            self.close()
            raise AgentLoadError(value)
        self._reader = threading.Thread(target=self._read, name=f"agent-worker-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The worker process's pid."""
        return self.process.pid

    def run(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Send one episode to the process (``cluster.agents.pool.AgentWorker.run``).

        Raises:
            AgentWorkerLost: the process cannot be reached.
        """
        future: Future[AgentOutcome] = Future()
        with self._lock:
            if self._closed:
                raise AgentWorkerLost(f"agent worker process {self.pid} is closed")
            rid = next(self._ids)
            self._futures[rid] = future
            try:
                self._sender.send((rid, ticket))
            except OSError as exc:
                del self._futures[rid]
                raise AgentWorkerLost(f"agent worker process {self.pid} cannot be reached: {exc}") from None
        return future

    def _read(self) -> None:
        """Resolve each episode's future as its outcome arrives; fail them all when the process is gone."""
        while True:
            try:
                rid, outcome = self._receiver.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with self._lock:
                future = self._futures.pop(rid, None)
            if future is not None:
                future.set_result(outcome)
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "none yet: its output pipe closed"
        with self._lock:
            self._closed = True
            pending, self._futures = list(self._futures.values()), {}
        for future in pending:
            future.set_exception(AgentWorkerLost(f"agent worker process {self.pid} exited (exit code {code})"))

    def close(self) -> None:
        """Kill the process and wait for it (idempotent); its running episodes' futures raise
        :class:`AgentWorkerLost`."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for connection in (self._sender, self._receiver):
            try:
                connection.close()
            except OSError:
                pass


def local_agent_pool(spec, imports: tuple[str, ...] = ()) -> AgentWorkerPool | None:
    """The in-process runtime's agent pool for ``spec`` (module docstring): None when the job runs no agent kind
    (``cluster.agents.plan.agent_kind_name``); nothing starts until :meth:`AgentWorkerPool.start`."""
    if agent_kind_name(spec.rollout) is None:
        return None
    plan, pool = build_plan(spec, imports), spec.rollout.agent_pool

    def make(index: int) -> ProcessAgentWorker:
        return ProcessAgentWorker(plan, pool.start_timeout_s)

    return AgentWorkerPool(make, pool.workers, pool.episodes_per_worker, pool.timeout_s, "local processes")
