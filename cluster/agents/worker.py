"""What runs inside an agent worker (a Ray actor, a local process): the job's agent kind, built from its
:class:`~cluster.agents.plan.AgentPlan`, and an asyncio event loop (a thread of its own) on which many episodes run
at once (:class:`AgentWorkerCore`).

    core = AgentWorkerCore(plan)                 # imports the agent; raises AgentLoadError naming file and line
    future = core.submit(ticket)                 # a concurrent.futures.Future[AgentOutcome], from any thread
    outcome = future.result()

One episode: an ``openai.AsyncOpenAI`` client for the ticket's base URL (no retries: a refused call is the agent's
to handle, and a retry would be a second call the endpoint records), the episode run awaited for at most
``rollout.agent_pool.timeout_s`` seconds (then cancelled: an infrastructure failure), and its return value or error
read as an :class:`~contract.agents.AgentOutcome` (``cluster.agents.outcomes``). The future never raises for the
agent's own faults. An agent that blocks the loop (a synchronous sleep) holds every episode of the worker; the
driver-side pool notices the worker's silence and replaces it (``cluster.agents.pool``).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import time
from concurrent.futures import Future

import openai

from cluster.agents.kinds import build_episode_run
from cluster.agents.loading import AgentLoadError
from cluster.agents.outcomes import one_line, outcome_of_error, outcome_of_return
from cluster.agents.plan import AgentPlan
from contract.agents import AgentOutcome, EpisodeTicket

__all__ = ["API_KEY", "AgentWorkerCore", "load_imports"]

#: The API key an episode's client sends (the endpoint serves one job; the key only satisfies the client).
API_KEY = "grpo-cluster"


def load_imports(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (``--import``) in this process.

    Raises:
        AgentLoadError: one does not import (its error's type and message).
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported with its cause, never a traceback
            raise AgentLoadError(f"agent worker: --import {module}: {type(exc).__name__}: {exc}") from None


class AgentWorkerCore:
    """One agent worker's state: the agent kind's episode run and the event loop the episodes share.

    Args:
        plan: the job's agent plan.

    Raises:
        AgentLoadError: an ``--import`` module or the agent does not load here (naming the file and line).
    """

    def __init__(self, plan: AgentPlan):
        load_imports(plan.imports)
        try:
            self.run_episode = build_episode_run(plan)
        except AgentLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - an environment that does not build here, an unknown kind
            raise AgentLoadError(f"agent worker: the {plan.kind} agent cannot be built: {type(exc).__name__}: "
                                 f"{one_line(str(exc))}") from None
        self.plan, self.pid = plan, os.getpid()
        self.agent_file = getattr(self.run_episode, "agent_file", None)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._thread.start()

    def submit(self, ticket: EpisodeTicket) -> Future[AgentOutcome]:
        """Run one episode on the loop (thread-safe); its future resolves with the outcome."""
        return asyncio.run_coroutine_threadsafe(self.episode(ticket), self.loop)

    async def episode(self, ticket: EpisodeTicket) -> AgentOutcome:
        """One episode (module docstring)."""
        t0 = time.monotonic()
        timeout_s = self.plan.timeout_s
        client = openai.AsyncOpenAI(base_url=ticket.base_url, api_key=API_KEY, max_retries=0, timeout=timeout_s)
        task = asyncio.ensure_future(self._guarded(client, dict(ticket.row)))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=5.0)  # let it unwind (its finally blocks), not longer
                return AgentOutcome(None, failure="infra", ended="infra_failed", seconds=time.monotonic() - t0,
                                    detail=f"the episode ran past rollout.agent_pool.timeout_s = {timeout_s:g} s "
                                           f"and was cancelled")
            try:
                value = task.result()
            except BaseException as exc:  # noqa: BLE001 - the agent's fault, an outcome (CancelledError included)
                return outcome_of_error(exc, time.monotonic() - t0, self.agent_file)
            return outcome_of_return(value, time.monotonic() - t0)
        finally:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - the episode is over
                pass

    async def _guarded(self, client, row: dict):
        """The episode run, with ``sys.exit`` (SystemExit) and KeyboardInterrupt inside the agent caught here as its
        failure: raised out of a task they would stop the worker's loop and every episode on it."""
        try:
            return await self.run_episode(client, row)
        except (SystemExit, KeyboardInterrupt) as exc:
            return outcome_of_error(exc, 0.0, self.agent_file)

    def close(self) -> None:
        """Stop the loop (episodes still running are abandoned)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
